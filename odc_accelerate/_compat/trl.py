"""Every TRL internal that odc_accelerate reads or patches, in one place, checked against the installed version.

SFT and DPO: the order and meaning of the metric gathers each trainer makes per microbatch, and the attributes they
feed; SFT also: ``SFTTrainer._prepare_dataset`` (padding-free data with ``max_length``); DPO also: the module-level
``prepare_fsdp`` name DPOTrainer uses for its reference model. The patches last for a ``with`` block only.

TRL's ``SFTTrainer.compute_loss`` calls ``accelerator.gather_for_metrics`` several times per microbatch and folds the
results into ``self._metrics`` and ``self._total_train_tokens``. The ODC trainer answers those gathers locally during
the microbatches and fixes the recorded values at the step boundary; that needs the ORDER of the gathers and the
names of the attributes they feed, which are private to TRL and pinned here.

The tested TRL versions are ``TESTED["trl"]`` in :mod:`odc_accelerate._compat`; the gather orders below are theirs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Iterator
from typing import Any

from . import check_signature, patched_attribute, require, untested_warning

logger = logging.getLogger(__name__)

_LIBRARY = "trl"

# Scalars SFTTrainer.compute_loss gathers per training microbatch, in call order.
SFT_TRAIN_GATHERS = ("num_valid", "entropy_sum", "num_correct", "num_tokens")


def check_sft(trainer: Any) -> None:
    """Raise `~odc_accelerate._compat.CompatError` if the SFT trainer lacks the metric attributes the ODC deferral
    rewrites.

    The order of TRL's gathers cannot be checked from outside; on an untested TRL version a warning says so.
    """
    detail = (
        "odc_accelerate reads the SFT metric gathers in the order of the tested versions "
        f"({', '.join(SFT_TRAIN_GATHERS)}); if TRL changed them, the logged entropy / mean_token_accuracy / "
        "num_tokens may be wrong (the loss and training are unaffected)."
    )
    if (warning := untested_warning(_LIBRARY, detail)) is not None:
        logger.warning(warning)
    for attr in ("_metrics", "_total_train_tokens"):
        require(trainer, attr, library=_LIBRARY, where="trl.SFTTrainer")


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
# order. An "aux_loss" gather comes first when the model's router aux loss is on.
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
    """Raise `~odc_accelerate._compat.CompatError` if the DPO trainer lacks an internal the ODC trainer reads or
    rewrites."""
    detail = (
        "odc_accelerate reads the DPO metric gathers in the order of the tested versions; if TRL changed them, the "
        "logged DPO metrics may be wrong (the loss and training are unaffected)."
    )
    if (warning := untested_warning(_LIBRARY, detail)) is not None:
        logger.warning(warning)
    for attr in (
        "_metrics",
        "_total_train_tokens",
        "aux_loss_enabled",
        "precompute_ref_logps",
        "loss_types",
        "ref_model",
    ):
        require(trainer, attr, library=_LIBRARY, where="trl.DPOTrainer")


@contextlib.contextmanager
def sft_padding_free_with_max_length(trainer: Any, args: Any) -> Iterator[None]:
    """Within the block (``SFTTrainer.__init__``), ``padding_free=True`` works together with ``max_length``.

    TRL refuses the pair without packing, since a padding-free batch of several sequences is one row that can exceed
    ``max_length``. Under a balanced ODC plan every microbatch is bounded by the plan's token budget instead, so the
    pair is well defined: TRL's check sees ``max_length=None`` while each sample is still truncated to
    ``max_length`` in TRL's own ``SFTTrainer._prepare_dataset`` (patched on this trainer only, for the block).
    """
    from trl import SFTTrainer

    where = "trl.SFTTrainer"
    advice = "Pass --padding_free false, or pre-truncate the data and pass --max_length None."
    method = require(SFTTrainer, "_prepare_dataset", library=_LIBRARY, where=where, advice=advice)
    check_signature(method, ("args",), library=_LIBRARY, where=f"{where}._prepare_dataset")
    max_length = args.max_length

    def wrap(original: Any) -> Any:
        signature = inspect.signature(original)  # bound: without `self`

        @functools.wraps(original)
        def _prepare_dataset(*call_args: Any, **call_kwargs: Any) -> Any:
            prep_args = signature.bind(*call_args, **call_kwargs).arguments["args"]
            prep_args.max_length = max_length
            try:
                return original(*call_args, **call_kwargs)
            finally:
                prep_args.max_length = None

        return _prepare_dataset

    with patched_attribute(trainer, "_prepare_dataset", wrap, library=_LIBRARY, where=where):
        args.max_length = None
        try:
            yield
        finally:
            args.max_length = max_length


@contextlib.contextmanager
def dpo_reference_preparer(prepare: Any) -> Iterator[None]:
    """Within the block, DPOTrainer prepares its reference model under FSDP with ``prepare(model, accelerator,
    trl_prepare)`` instead of TRL's ``prepare_fsdp`` (which shards the root only, so every reference forward is one
    whole-model all-gather). ``trl_prepare(model, accelerator)`` is TRL's own, for the cases ``prepare`` leaves to it.
    """
    from trl.trainer import dpo_trainer

    where = "trl.trainer.dpo_trainer"
    current = require(dpo_trainer, "prepare_fsdp", library=_LIBRARY, where=where)
    check_signature(current, ("model", "accelerator"), library=_LIBRARY, where=f"{where}.prepare_fsdp")

    def wrap(original: Any) -> Any:
        def trl_prepare(model: Any, accelerator: Any) -> Any:
            return original(model=model, accelerator=accelerator)

        @functools.wraps(original)
        def prepare_fsdp(model: Any, accelerator: Any) -> Any:
            return prepare(model, accelerator, trl_prepare)

        return prepare_fsdp

    with patched_attribute(dpo_trainer, "prepare_fsdp", wrap, library=_LIBRARY, where=where):
        yield


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
