"""The PNG of a GRPO benchmark result: per-rank generation / training / wait per arm, and step time per arm."""

from __future__ import annotations

from pathlib import Path

from benchmarks.e2e.plot import pyplot
from benchmarks.grpo.arms import ARMS, baseline_of


def plot(result: dict, path: Path, title: str = "") -> bool:
    """Per-rank generation / training / wait of the mean step of each arm's median run (left) and the median step
    time per arm (right), in the end-to-end benchmark's style; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    arms = result["arms"]
    names = [n for n in ARMS if n in arms]
    world = result["config"]["world_size"]
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(12, 0.55 * len(names) * world + 2.4), width_ratios=(3, 2))
    labels, ticks, y = [], [], 0.0
    parts = (("generation_s", "tab:orange", 1.0), ("training_s", "tab:blue", 1.0), ("wait_s", "tab:red", 0.6))
    for name in reversed(names):
        t = result["timeline"][name]
        for r in reversed(range(world)):
            left = 0.0
            for key, color, alpha in parts:
                ax_t.barh(y, t[key][r], left=left, color=color, alpha=alpha, height=0.8)
                left += t[key][r]
            labels.append(f"{arms[name]['label']}  r{r}")
            ticks.append(y)
            y += 1
        y += 0.6
    ax_t.set_yticks(ticks, labels, fontsize=8)
    ax_t.set_xlabel("seconds in one optimizer step (mean over the measured steps of the median run)")
    ax_t.set_title(
        "per rank: inside generate (orange), own training compute (blue), rest of the step (red)", fontsize=9
    )
    steps = [arms[n]["step_s"] for n in reversed(names)]
    ax_s.barh(range(len(names)), steps, color="tab:gray")
    ax_s.set_yticks(range(len(names)), [arms[n]["label"] for n in reversed(names)], fontsize=8)
    ratios = result.get("ratios", {})
    for i, n in enumerate(reversed(names)):
        text = f"{arms[n]['step_s']:.2f} s"
        if n in ratios:
            text += f"  ({ratios[n]['step_s']['median']:.2f}x of {ARMS[baseline_of(n)].label})"
        ax_s.text(arms[n]["step_s"], i, " " + text, va="center", fontsize=8)
    ax_s.set_xlabel("seconds per optimizer step, median over repeats")
    ax_s.set_xlim(0, 1.9 * max(steps))
    fig.suptitle(title, fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return True
