"""TRL's DPOTrainer: the metric gathers it makes per microbatch, and how it prepares its reference model under FSDP."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .. import require, warn_if_untested
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
