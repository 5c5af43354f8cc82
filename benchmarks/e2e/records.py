"""One run's figures from what its processes left behind: the trainer's log, peak RSS files and step traces."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.e2e.arms import Arm


def parse_log_history(log_history: list[dict]) -> list[dict]:
    """Per-step figures from ``trainer_state.json``'s ``log_history`` (``--logging_steps 1``)."""
    steps = []
    for row in log_history:
        if "odc/step_s" not in row:
            continue
        ranks = sorted(int(k[len("odc/busy_s_rank") :]) for k in row if k.startswith("odc/busy_s_rank"))
        step_s = float(row["odc/step_s"])
        steps.append(
            {
                "step": int(row.get("step", len(steps) + 1)),
                "step_s": step_s,
                # the trainer logs tokens/s rounded to 0.1 and step_s to 0.1 ms: tokens come back to within 1
                "tokens": round(float(row["odc/tokens_per_s"]) * step_s),
                "busy_s": [float(row[f"odc/busy_s_rank{r}"]) for r in ranks],
                "wait_s": [float(row[f"odc/wait_s_rank{r}"]) for r in ranks],
                "bubble_pct": float(row.get("odc/bubble_pct", 0.0)),
                "microbatches_min_max": [
                    int(row.get("odc/microbatches_min", 0)),
                    int(row.get("odc/microbatches_max", 0)),
                ],
            }
        )
    return steps


def summarize_run(steps: list[dict], warmup: int, share: int = 1) -> dict:
    """One run's figures over its measured steps (the first ``warmup`` steps dropped).

    ``share``: how many ranks' work one process did (the limit: W; a rank's share of the step is step time / W).
    """
    measured = steps[warmup:]
    if not measured:
        raise ValueError(f"no measured step: {len(steps)} logged step(s), warmup {warmup}; raise --max_steps")
    times = [s["step_s"] / share for s in measured]
    tokens = sum(s["tokens"] for s in measured)
    total = sum(times)
    ranks = len(measured[0]["busy_s"]) if share == 1 else share
    if share == 1:
        busy = [statistics.fmean(s["busy_s"][r] for s in measured) for r in range(ranks)]
        wait = [statistics.fmean(s["wait_s"][r] for s in measured) for r in range(ranks)]
        mean_busy_total = sum(statistics.fmean(s["busy_s"]) for s in measured)
    else:  # one process did W ranks' work with no communication: a rank's share is 1/W of its busy and its wait
        busy = [statistics.fmean(s["busy_s"][0] / share for s in measured)] * ranks
        wait = [statistics.fmean((s["step_s"] - s["busy_s"][0]) / share for s in measured)] * ranks
        mean_busy_total = sum(s["busy_s"][0] / share for s in measured)
    return {
        "steps_measured": len(measured),
        "step_s_median": statistics.median(times),
        "step_s_mean": total / len(measured),
        "tokens": tokens,
        "tokens_per_s": tokens / total,
        "busy_s": busy,
        "wait_s": wait,
        "bubble_pct": 100.0 * (1.0 - mean_busy_total / total),
        "microbatches_min_max": [
            min(s["microbatches_min_max"][0] for s in measured),
            max(s["microbatches_min_max"][1] for s in measured),
        ],
    }


def make_record(arm: Arm, per_process: list[list[dict]], rss: list[float], warmup: int, world: int) -> dict:
    """One run's record from the per-step figures of its process(es) (one launch, or the limit's W processes)."""
    share = world if arm.config is None else 1
    summaries = [summarize_run(steps, warmup, share) for steps in per_process]
    return {
        "arm": arm.name,
        "processes": len(per_process),
        "steps": per_process if arm.config is None else per_process[0],  # the limit: one list per process
        "summary": _mean_of(summaries) if len(summaries) > 1 else summaries[0],
        "peak_rss_mb": rss,
    }


def _mean_of(summaries: list[dict]) -> dict:
    """Mean of the limit's concurrent processes (identical work)."""
    out: dict[str, Any] = {}
    for key, value in summaries[0].items():
        if isinstance(value, list):
            out[key] = [statistics.fmean(s[key][i] for s in summaries) for i in range(len(value))]
        elif key in ("steps_measured", "tokens"):
            out[key] = value
        else:
            out[key] = statistics.fmean(s[key] for s in summaries)
    return out


def read_rss(directory: Path) -> list[float]:
    """Peak RSS (MB) per rank from the ``rss_rank<r>.json`` files the example wrapper writes at exit."""
    files = sorted(directory.glob("rss_rank*.json"), key=lambda p: int(p.stem[len("rss_rank") :]))
    return [json.loads(p.read_text())["peak_rss_mb"] for p in files]


def padding_pct(traces: list[list[list[dict]]], warmup: int) -> float | None:
    """The share (%) of the tokens the model computed that were padding, over the measured steps (the first
    ``warmup`` dropped) of every process and rank: ``1 - real tokens / (rows x width)`` of each microbatch, from the
    step traces (``[process][rank][step]``, `read_trace`); `None` without traces. A packed row (one row of several
    sequences) has none."""
    computed = real = 0
    for ranks in traces:
        for steps in ranks:
            for step in steps:
                if int(step["step"]) <= warmup:
                    continue
                for mb in step["microbatches"]:
                    computed += int(mb["rows"]) * int(mb["width"])
                    real += sum(int(t) for t in mb["row_tokens"])
    return 100.0 * (1.0 - real / computed) if computed else None


def read_trace(directory: Path) -> list[list[dict]]:
    """``[rank][step]`` rows of the `odc_accelerate.telemetry.StepTrace` files in ``directory`` (empty if none)."""
    files = sorted(directory.glob("trace_rank*.jsonl"), key=lambda f: int(f.stem[len("trace_rank") :]))
    return [[json.loads(line) for line in f.read_text().splitlines() if line.strip()] for f in files]
