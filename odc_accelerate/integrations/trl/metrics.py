"""What the TRL trainers' step metrics share: from the per-microbatch values recorded locally to one global value.

During a step's microbatches the trainers' metric gathers are answered with this rank's values
(`~odc_accelerate.integrations.trainer.metrics.DeferredGather`); at the step boundary one reduction gives the sums of
every rank (`~odc_accelerate.integrations.trainer.metrics.StepMetrics`), and each trainer's ``finalize_*_metrics`` (in
its own module) replaces what TRL recorded for each microbatch with the value one process logs when the global batch is
one microbatch. What each gather means, in TRL's call order, is pinned in `odc_accelerate._compat.trl`.
"""

from __future__ import annotations

import logging
from typing import Any

from ..._compat import tested_text
from ..trainer.metrics import StepMetrics

logger = logging.getLogger(__name__)

__all__ = ["check_gathers", "drop_microbatch_values", "one_step_time", "ratio", "step_value"]


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def drop_microbatch_values(recorded: dict[str, list], keys: Any, microbatches: int) -> None:
    """Remove the values TRL recorded for each of the step's ``microbatches`` under ``keys``."""
    for key in keys:
        if microbatches and key in recorded:
            del recorded[key][-microbatches:]


def step_value(metrics: StepMetrics, i: int, how: str) -> float:
    """The step's value of the ``i``-th gather of a microbatch: a ratio of summed values, a minimum, a maximum, or
    the sum of values weighted per microbatch (``"sum"``)."""
    if how == "ratio":
        return metrics.global_sums[i] / max(metrics.global_counts[i], 1.0)
    if how == "sum":
        return metrics.global_sums[i]
    return metrics.global_mins[i] if how == "min" else metrics.global_maxs[i]


def one_step_time(recorded: dict[str, list], microbatches: int) -> None:
    """TRL's per-microbatch ``step_time`` becomes the step's (their sum)."""
    times = recorded.get("step_time")
    if microbatches and times is not None and len(times) >= microbatches:
        step_time = sum(times[-microbatches:])
        del times[-microbatches:]
        times.append(step_time)


def check_gathers(
    trainer: str, metrics: StepMetrics, expected: int, *, what: str = "metric gathers", kept: str = "metrics"
) -> bool:
    """Whether the step made the ``expected`` gathers per microbatch (the TRL release's call order, pinned in
    `odc_accelerate._compat.trl`); if not, a warning that the step's ``kept`` stay local (the trainer then leaves TRL's
    values)."""
    if metrics.gathers_per_microbatch == expected:
        return True
    logger.warning(
        "ODC: %s made %d %s per microbatch, expected %d (tested with TRL %s); the %s of this step are local.",
        trainer,
        metrics.gathers_per_microbatch,
        what,
        expected,
        tested_text("trl"),
        kept,
    )
    return False
