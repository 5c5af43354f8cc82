"""The PNG of an end-to-end result: per-rank busy / wait of one step per arm, and tokens/s per arm."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from benchmarks.e2e.arms import ARMS, BASELINES


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or `None` (with a note on stderr) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed: no PNG written (pip install matplotlib, or pip install -e '.[bench]').",
            file=sys.stderr,
        )
        return None
    return plt


def plot(result: dict, path: Path, title: str = "") -> bool:
    """Per-rank busy/wait of one step per arm (left) and tokens/s per arm (right); False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    arms = result["arms"]
    names = [n for n in ARMS if n in arms]
    world = result["config"]["world_size"]
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 0.55 * len(names) * world + 2.2), width_ratios=(3, 2))
    labels, ticks, y = [], [], 0.0
    for name in reversed(names):
        t = result["timeline"][name]
        for r in reversed(range(world)):
            busy, wait = t["busy_s"][r], t["wait_s"][r]
            ax_t.barh(y, busy, color="tab:blue" if name != "limit" else "tab:green", height=0.8)
            ax_t.barh(y, wait, left=busy, color="tab:red", alpha=0.6, height=0.8)
            labels.append(f"{arms[name]['label']}  r{r}")
            ticks.append(y)
            y += 1
        y += 0.6
    ax_t.set_yticks(ticks, labels, fontsize=8)
    ax_t.set_xlabel("seconds in one optimizer step (median step of the median run)")
    ax_t.set_title("per rank: own forward + backward (blue), rest of the step (red)", fontsize=9)
    ax_b.barh(range(len(names)), [arms[n]["tokens_per_s"] for n in reversed(names)], color="tab:gray")
    ax_b.set_yticks(range(len(names)), [arms[n]["label"] for n in reversed(names)], fontsize=8)
    base = next((b for b in BASELINES if b in arms), None)  # the first baseline the run has
    for i, n in enumerate(reversed(names)):
        text = f"{arms[n]['tokens_per_s']:.0f}"
        if base is not None and n != base:
            text += f"  ({arms[n][f'speedup_vs_{base}']:.2f}x vs {ARMS[base].label.split(' + ')[1]})"
        ax_b.text(arms[n]["tokens_per_s"], i, " " + text, va="center", fontsize=8)
    ax_b.set_xlabel("real (non-padding) tokens/s, median over repeats")
    ax_b.set_xlim(0, 1.75 * max(a["tokens_per_s"] for a in arms.values()))
    fig.suptitle(title, fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return True
