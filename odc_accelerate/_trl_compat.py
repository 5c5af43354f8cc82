"""Every TRL internal that odc_accelerate reads, in one place, checked against the installed version.

TRL's ``SFTTrainer.compute_loss`` calls ``accelerator.gather_for_metrics`` several times per microbatch and folds the
results into ``self._metrics`` and ``self._total_train_tokens``. The ODC trainer answers those gathers locally during
the microbatches and fixes the recorded values at the step boundary; that needs the ORDER of the gathers and the
names of the attributes they feed, which are private to TRL and pinned here.

Tested against TRL 1.16.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

TESTED_TRL = ((1, 16),)

# Scalars SFTTrainer.compute_loss gathers per training microbatch, in call order (TRL 1.16).
SFT_TRAIN_GATHERS = ("num_valid", "entropy_sum", "num_correct", "num_tokens")


class TRLCompatError(RuntimeError):
    """The installed TRL lacks an internal that odc_accelerate relies on."""


def _version() -> tuple[int, int]:
    import trl

    major, minor = trl.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def check_sft(trainer: Any) -> None:
    """Raise `TRLCompatError` if the SFT trainer lacks the metric attributes the ODC deferral rewrites.

    The order of TRL's gathers cannot be checked from outside; on an untested TRL version a warning says so.
    """
    import trl

    if _version() not in TESTED_TRL:
        logger.warning(
            "odc_accelerate reads TRL %s's SFT metric gathers in the order of TRL %s (%s); if TRL changed them, the "
            "logged entropy / mean_token_accuracy / num_tokens may be wrong (the loss and training are unaffected).",
            trl.__version__,
            TESTED_TRL,
            ", ".join(SFT_TRAIN_GATHERS),
        )

    for attr in ("_metrics", "_total_train_tokens"):
        if not hasattr(trainer, attr):
            tested = ", ".join(f"{a}.{b}" for a, b in TESTED_TRL)
            raise TRLCompatError(
                f"odc_accelerate needs the TRL internal `SFTTrainer.{attr}`, which TRL {trl.__version__} does not have "
                f"(tested with TRL {tested}). Install a supported TRL (pip install 'odc_accelerate[hf]') or upgrade "
                "odc_accelerate."
            )


def finalize_sft_metrics(
    trainer: Any, local_sums: list[float], global_sums: list[float], local_microbatches: int
) -> None:
    """Turn the per-microbatch local SFT metrics of one step into the global ones of the whole step.

    ``entropy`` and ``mean_token_accuracy`` become one token-weighted value over every label token of the step on
    every rank (what one process logs when the global batch is one microbatch); ``num_tokens`` counts the input tokens
    of all ranks, as TRL does with its per-microbatch gathers.
    """
    metrics = trainer._metrics["train"]
    g = dict(zip(SFT_TRAIN_GATHERS, global_sums, strict=False))
    mine = dict(zip(SFT_TRAIN_GATHERS, local_sums, strict=False))
    for key in ("entropy", "mean_token_accuracy"):
        values = metrics[key]
        if local_microbatches:
            del values[-local_microbatches:]
    num_valid = g["num_valid"]
    metrics["entropy"].append(g["entropy_sum"] / num_valid if num_valid > 0 else 0.0)
    metrics["mean_token_accuracy"].append(g["num_correct"] / num_valid if num_valid > 0 else 0.0)
    tp = int(getattr(trainer, "_tp_size", 1) or 1)
    trainer._total_train_tokens += int(g["num_tokens"]) // tp - int(mine["num_tokens"]) // tp
    metrics["num_tokens"] = [trainer._total_train_tokens]
