"""One GRPO run's figures from its trainer's log: per step, then over the run's measured steps."""

from __future__ import annotations

import statistics

from benchmarks.e2e import records as e2e_records


def parse_log_history(log_history: list[dict]) -> list[dict]:
    """Per-step figures from ``trainer_state.json``'s ``log_history`` (``--logging_steps 1``).

    The end-to-end benchmark's figures (`benchmarks.e2e.records.parse_log_history`: step time, real tokens, per-rank
    busy and wait, microbatches) plus, per rank, the time inside ``generate`` (``generation_s``) and the rest of busy,
    own training compute (``training_s = busy - generation``), and TRL's completion lengths, reward and loss.

    Raises:
        ValueError: a step row without the per-rank generation times (not a GRPO run of the ODC trainer).
    """
    rows = [row for row in log_history if "odc/step_s" in row]
    steps = e2e_records.parse_log_history(rows)
    for step, row in zip(steps, rows, strict=True):
        ranks = range(len(step["busy_s"]))
        missing = [f"odc/generation_s_rank{r}" for r in ranks if f"odc/generation_s_rank{r}" not in row]
        if missing:
            raise ValueError(
                f"step {step['step']} logs no {missing[0]}: the run is not a GRPO run of ODCGRPOTrainer (or made no "
                "generate call)."
            )
        step["generation_s"] = [float(row[f"odc/generation_s_rank{r}"]) for r in ranks]
        step["training_s"] = [b - g for b, g in zip(step["busy_s"], step["generation_s"], strict=True)]
        step["completion_mean_length"] = float(row.get("completions/mean_length", 0.0))
        step["completion_max_length"] = float(row.get("completions/max_length", 0.0))
        step["reward"] = float(row["reward"]) if "reward" in row else None
        step["loss"] = float(row["loss"]) if "loss" in row else None
    return steps


def summarize_run(steps: list[dict], warmup: int) -> dict:
    """One run's figures over its measured steps (the first ``warmup`` steps dropped).

    A GRPO step's work depends on the lengths its prompts draw, so the run's figures are means over its measured
    steps (every arm draws the same prompts in the same order: their means are over the same work): ``step_s``,
    ``generation_s`` / ``training_s`` / ``wait_s`` per rank, ``generation_max_s`` (per step, the slowest rank's time
    inside ``generate``); ``tokens_per_s`` is real tokens over summed step time; ``completion_mean_length`` is the
    mean over every measured completion and ``completion_max_length`` the longest one.
    """
    measured = steps[warmup:]
    if not measured:
        raise ValueError(f"no measured step: {len(steps)} logged step(s), warmup {warmup}; raise --max_steps")
    ranks = range(len(measured[0]["busy_s"]))
    total = sum(s["step_s"] for s in measured)
    busy_mean_total = sum(statistics.fmean(s["busy_s"]) for s in measured)
    rewards = [s["reward"] for s in measured if s["reward"] is not None]
    return {
        "steps_measured": len(measured),
        "step_s": total / len(measured),
        "step_s_median": statistics.median(s["step_s"] for s in measured),
        "tokens": sum(s["tokens"] for s in measured),
        "tokens_per_s": sum(s["tokens"] for s in measured) / total,
        "generation_s": [statistics.fmean(s["generation_s"][r] for s in measured) for r in ranks],
        "training_s": [statistics.fmean(s["training_s"][r] for s in measured) for r in ranks],
        "busy_s": [statistics.fmean(s["busy_s"][r] for s in measured) for r in ranks],
        "wait_s": [statistics.fmean(s["wait_s"][r] for s in measured) for r in ranks],
        "generation_max_s": statistics.fmean(max(s["generation_s"]) for s in measured),
        "bubble_pct": 100.0 * (1.0 - busy_mean_total / total),
        # every step has the same number of completions: the mean of the steps' means is the mean completion
        "completion_mean_length": statistics.fmean(s["completion_mean_length"] for s in measured),
        "completion_max_length": max(s["completion_max_length"] for s in measured),
        "reward": statistics.fmean(rewards) if rewards else None,
        "microbatches_min_max": [
            min(s["microbatches_min_max"][0] for s in measured),
            max(s["microbatches_min_max"][1] for s in measured),
        ],
    }


def make_record(arm: str, steps: list[dict], rss: list[float], warmup: int, repeat: int) -> dict:
    """One run's record: its arm, repeat, per-step figures, summary and per-rank peak RSS (MB)."""
    return {
        "arm": arm,
        "repeat": repeat,
        "steps": steps,
        "summary": summarize_run(steps, warmup),
        "peak_rss_mb": rss,
    }
