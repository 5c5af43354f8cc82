"""Statistics over the repeats of the GRPO benchmark: per-arm medians and ODC / FSDP2 ratios taken within repeats
(each arm over FSDP2 as TRL runs the same trainer: GRPO's arms over ``fsdp2``, RLOO's over ``rloo_fsdp2``)."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.grpo.arms import ARMS, baseline_of

RATIOS = ("step_s", "generation_max_s", "tokens_per_s")
"""Per-run figures whose arm / baseline ratio is reported (< 1 is faster for the two times, > 1 for tokens/s)."""

_SCALARS = (
    "step_s",
    "tokens_per_s",
    "generation_max_s",
    "bubble_pct",
    "completion_mean_length",
    "completion_max_length",
)
_PER_RANK = ("generation_s", "training_s", "wait_s", "busy_s")


def aggregate(runs: dict[str, list[dict]]) -> dict:
    """Per-arm medians over repeats, ratios of every arm to its baseline within each repeat, one step's timeline per
    arm.

    Args:
        runs (`dict[str, list[dict]]`): arm name -> the records of its runs (`benchmarks.grpo.records.make_record`,
            with their ``repeat``).

    Returns:
        `dict`: ``arms`` (per arm: the median over repeats of each run figure, per rank for the per-rank ones, the
        peak RSS per rank as the maximum over repeats, and each repeat's ``step_s`` and ``tokens_per_s``),
        ``ratios`` (per arm whose baseline, `benchmarks.grpo.arms.baseline_of`, ran, and per figure of `RATIOS`:
        ``per_repeat``, the arm's figure over the baseline's in the same repeat, and their ``median``), and ``timeline`` (per arm, the per-rank means of its median run).
    """
    arms: dict[str, dict[str, Any]] = {}
    for name, arm_runs in runs.items():
        sums = [r["summary"] for r in _by_repeat(arm_runs)]
        world = len(sums[0]["busy_s"])
        med: dict[str, Any] = {"label": ARMS[name].label, "repeats": len(sums)}
        for key in _SCALARS:
            med[key] = statistics.median(s[key] for s in sums)
        for key in _PER_RANK:
            med[key] = [statistics.median(s[key][r] for s in sums) for r in range(world)]
        rewards = [s["reward"] for s in sums if s.get("reward") is not None]
        med["reward"] = statistics.median(rewards) if rewards else None
        med["microbatches_min_max"] = [
            min(s["microbatches_min_max"][0] for s in sums),
            max(s["microbatches_min_max"][1] for s in sums),
        ]
        rss = [r["peak_rss_mb"] for r in arm_runs if r.get("peak_rss_mb")]
        med["peak_rss_mb"] = [max(x[i] for x in rss) for i in range(len(rss[0]))] if rss else []
        med["step_s_runs"] = [s["step_s"] for s in sums]
        med["tokens_per_s_runs"] = [s["tokens_per_s"] for s in sums]
        arms[name] = med
    ratios: dict[str, dict] = {}
    for name, arm_runs in runs.items():
        baseline = baseline_of(name)
        if name == baseline or baseline not in runs:
            continue
        base = {r["repeat"]: r["summary"] for r in runs[baseline]}
        pairs = [(r["summary"], base[r["repeat"]]) for r in _by_repeat(arm_runs) if r["repeat"] in base]
        if not pairs:
            continue
        ratios[name] = {}
        for key in RATIOS:
            per_repeat = [a[key] / b[key] for a, b in pairs]
            ratios[name][key] = {"per_repeat": per_repeat, "median": statistics.median(per_repeat)}
    return {"arms": arms, "ratios": ratios, "timeline": {name: _timeline(r) for name, r in runs.items()}}


def _by_repeat(runs: list[dict]) -> list[dict]:
    return sorted(runs, key=lambda r: r.get("repeat", 0))


def _timeline(arm_runs: list[dict]) -> dict:
    """The run of median step time (the lower middle one for an even count): its mean step, per rank."""
    ordered = sorted(arm_runs, key=lambda r: r["summary"]["step_s"])
    run = ordered[(len(ordered) - 1) // 2]
    s = run["summary"]
    parts = {k: s[k] for k in ("generation_s", "training_s", "wait_s")}
    return {"repeat": run["repeat"], "step_s": s["step_s"], **parts}
