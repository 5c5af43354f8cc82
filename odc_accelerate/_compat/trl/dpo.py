"""TRL's DPOTrainer: the metric gathers it makes per microbatch, and how it prepares its reference model under FSDP."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .. import CompatError, require, warn_if_untested
from . import _LIBRARY, _reference_preparer

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
DPO_PER_MICROBATCH = (
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
    warn_if_untested(_LIBRARY, detail)
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
def dpo_reference_preparer(prepare: Any) -> Iterator[None]:
    """Within the block, DPOTrainer prepares its reference model under FSDP with ``prepare(model, accelerator,
    trl_prepare)`` instead of TRL's ``prepare_fsdp`` (which shards the root only, so every reference forward is one
    whole-model all-gather). ``trl_prepare(model, accelerator)`` is TRL's own, for the cases ``prepare`` leaves to it.
    """
    from trl.trainer import dpo_trainer

    with _reference_preparer(dpo_trainer, "trl.trainer.dpo_trainer", prepare):
        yield


#: The warning with which TRL 1.16's DPOTrainer turns ``padding_free=True`` off.
_PADDING_FREE_WARNING = "`padding_free=True` is temporarily unavailable"


@contextlib.contextmanager
def padding_free_warning_silenced() -> Iterator[None]:
    """Within the block (``DPOTrainer.__init__`` of a trainer that packs its pairs itself), TRL's warning that it falls
    back to padding is left out: the pairs are packed, so it would say the opposite of what happens."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return _PADDING_FREE_WARNING not in str(record.getMessage())

    logger = logging.getLogger("trl.trainer.dpo_trainer")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def fused_per_token_fields() -> tuple[str, ...]:
    """The per-token fields of TRL's fused LM head output (``FusedCausalLMOutput``: log-probs, entropy, ...), each of
    shape ``(rows, width - 1)``: what a packed forward scatters back to the padded rows."""
    import dataclasses

    from trl.trainer import utils

    output = require(utils, "FusedCausalLMOutput", library=_LIBRARY, where="trl.trainer.utils")
    names = tuple(f.name for f in dataclasses.fields(output) if f.name not in ("loss", "aux_loss"))
    if "log_probs" not in names:
        raise CompatError(
            "trl.trainer.utils.FusedCausalLMOutput has no log_probs field: the installed TRL changed its fused LM head, "
            "which the packed DPO forward reads. Pass --padding_free false."
        )
    return names
