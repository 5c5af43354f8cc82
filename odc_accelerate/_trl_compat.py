"""Every TRL internal that odc_accelerate reads, in one place, checked against the installed version.

SFT and DPO: the order and meaning of the metric gathers each trainer makes per microbatch, and the attributes they
feed; DPO also: the module-level ``prepare_fsdp`` name DPOTrainer uses for its reference model.

TRL's ``SFTTrainer.compute_loss`` calls ``accelerator.gather_for_metrics`` several times per microbatch and folds the
results into ``self._metrics`` and ``self._total_train_tokens``. The ODC trainer answers those gathers locally during
the microbatches and fixes the recorded values at the step boundary; that needs the ORDER of the gathers and the
names of the attributes they feed, which are private to TRL and pinned here.

Tested against TRL 1.16.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
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


# ----------------------------------------------------------------------------------------------------------- DPO
# What DPOTrainer._compute_loss passes to accelerator.gather / gather_for_metrics per training microbatch, in call
# order (TRL 1.16). An "aux_loss" gather comes first when the model's router aux loss is on.
DPO_TRAIN_GATHERS = (
    "entropy_sum",
    "entropy_tokens",
    "num_tokens",
    "chosen_logits_sum",
    "chosen_tokens",
    "rejected_logits_sum",
    "rejected_tokens",
    "correct_tokens",
    "accuracy_tokens",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)

# Metrics that DPOTrainer appends once per microbatch (the ODC trainer replaces them with one value per step).
_DPO_PER_MICROBATCH = (
    "aux_loss",
    "entropy",
    "logits/chosen",
    "logits/rejected",
    "mean_token_accuracy",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def dpo_gathers(trainer: Any) -> tuple[str, ...]:
    return (("aux_loss",) if getattr(trainer, "aux_loss_enabled", False) else ()) + DPO_TRAIN_GATHERS


def check_dpo(trainer: Any) -> None:
    """Raise `TRLCompatError` if the DPO trainer lacks an internal the ODC trainer reads or rewrites."""
    import trl

    if _version() not in TESTED_TRL:
        logger.warning(
            "odc_accelerate reads TRL %s's DPO metric gathers in the order of TRL %s; if TRL changed them, the logged "
            "DPO metrics may be wrong (the loss and training are unaffected).",
            trl.__version__,
            TESTED_TRL,
        )
    for attr in (
        "_metrics",
        "_total_train_tokens",
        "aux_loss_enabled",
        "precompute_ref_logps",
        "loss_types",
        "ref_model",
    ):
        if not hasattr(trainer, attr):
            tested = ", ".join(f"{a}.{b}" for a, b in TESTED_TRL)
            raise TRLCompatError(
                f"odc_accelerate needs the TRL internal `DPOTrainer.{attr}`, which TRL {trl.__version__} does not have "
                f"(tested with TRL {tested}). Install a supported TRL (pip install 'odc_accelerate[hf]') or upgrade "
                "odc_accelerate."
            )


@contextlib.contextmanager
def sft_padding_free_with_max_length(trainer: Any, args: Any) -> Iterator[None]:
    """Within the block (``SFTTrainer.__init__``), ``padding_free=True`` works together with ``max_length``.

    TRL 1.16 refuses the pair without packing, since a padding-free batch of several sequences is one row that can
    exceed ``max_length``. Under a balanced ODC plan every microbatch is bounded by the plan's token budget instead,
    so the pair is well defined: TRL's check sees ``max_length=None`` while each sample is still truncated to
    ``max_length`` in TRL's own ``SFTTrainer._prepare_dataset``.
    """
    import types

    from trl import SFTTrainer

    if not hasattr(SFTTrainer, "_prepare_dataset"):
        raise TRLCompatError(
            "odc_accelerate truncates padding-free SFT data through `trl.SFTTrainer._prepare_dataset`, which this TRL "
            "does not have (tested with TRL 1.16). Pass --padding_free false, or pre-truncate the data and pass "
            "--max_length None."
        )
    max_length = args.max_length
    original = SFTTrainer._prepare_dataset

    def prepare(self: Any, dataset: Any, processing_class: Any, prep_args: Any, *rest: Any, **kwargs: Any) -> Any:
        prep_args.max_length = max_length
        try:
            return original(self, dataset, processing_class, prep_args, *rest, **kwargs)
        finally:
            prep_args.max_length = None

    trainer._prepare_dataset = types.MethodType(prepare, trainer)
    args.max_length = None
    try:
        yield
    finally:
        args.max_length = max_length
        del trainer._prepare_dataset


@contextlib.contextmanager
def dpo_reference_preparer(prepare: Any) -> Iterator[None]:
    """Within the block, DPOTrainer prepares its reference model under FSDP with ``prepare(model, accelerator, trl's)``
    instead of TRL's ``prepare_fsdp`` (which shards the root only, so every reference forward is one whole-model
    all-gather)."""
    from trl.trainer import dpo_trainer

    if not hasattr(dpo_trainer, "prepare_fsdp"):
        raise TRLCompatError(
            "odc_accelerate replaces `trl.trainer.dpo_trainer.prepare_fsdp` while DPOTrainer builds its reference "
            "model, but this TRL has no such name (tested with TRL 1.16)."
        )
    original = dpo_trainer.prepare_fsdp
    dpo_trainer.prepare_fsdp = lambda model, accelerator: prepare(model, accelerator, original)
    try:
        yield
    finally:
        dpo_trainer.prepare_fsdp = original


def finalize_dpo_metrics(
    trainer: Any,
    local_sums: list[float],
    global_sums: list[float],
    global_counts: list[float],
    local_microbatches: int,
) -> None:
    """Turn the per-microbatch local DPO metrics of one step into one value per metric for the whole step.

    Token-weighted metrics (entropy, logits, token accuracy) are ratios of global sums; reward and log-prob metrics
    are means over every pair of the step on every rank (what one process logs when the global batch is one
    microbatch); ``num_tokens`` counts the input tokens of all ranks.
    """
    names = dpo_gathers(trainer)
    total = dict(zip(names, global_sums, strict=False))
    count = dict(zip(names, global_counts, strict=False))
    mine = dict(zip(names, local_sums, strict=False))
    metrics = trainer._metrics["train"]
    for key in _DPO_PER_MICROBATCH:
        if local_microbatches and key in metrics:
            del metrics[key][-local_microbatches:]

    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else 0.0

    values = {
        "entropy": ratio(total["entropy_sum"], total["entropy_tokens"]),
        "logits/chosen": ratio(total["chosen_logits_sum"], total["chosen_tokens"]),
        "logits/rejected": ratio(total["rejected_logits_sum"], total["rejected_tokens"]),
        "mean_token_accuracy": ratio(total["correct_tokens"], total["accuracy_tokens"]),
    }
    for key in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ):
        values[key] = ratio(total[key], count[key])
    if "aux_loss" in names:
        values["aux_loss"] = ratio(total["aux_loss"], count["aux_loss"])
    for key, value in values.items():
        metrics[key].append(value)
    tp = int(getattr(trainer, "_tp_size", 1) or 1)
    trainer._total_train_tokens += int(total["num_tokens"]) // tp - int(mine["num_tokens"]) // tp
    metrics["num_tokens"] = [trainer._total_train_tokens]
