"""The TRL internals the KTO trainer reads or patches, checked against the installed version.

TRL's ``KTOTrainer._compute_loss`` makes, per training microbatch and in this order (TRL 1.16):

1. ``gather_for_metrics((KL_logps - ref_KL_logps).mean())``, averaged over ranks and clamped at 0: the KL estimate
   ``z0`` that enters the loss (only when the loss type estimates it, ``calculate_KL``);
2. the entropy sum and its token count; 3. the input tokens (``num_tokens``, train only);
4. the chosen / rejected logit sums and their token counts;
5. ``num_chosen`` / ``num_rejected``; then, when the GATHERED count of a side is above 0, that side's reward sum and
   log-prob sum;
6. ``aux_loss`` when the router's auxiliary loss is on.

The KL log-probs come from ``KTOTrainer._compute_kl_logps(model, batch)``: a no-gradient forward of the KL sequences,
called for the policy and then for the reference (unless the reference log-probs were precomputed). Every result is
appended to ``self._metrics["train"][name]`` and averaged at the next log. The ODC trainer computes ``z0`` once per
step, answers these gathers locally and replaces the recorded values at the step boundary; that needs the order
above and the names below, which are private to TRL and pinned here. The tested TRL versions are ``TESTED["trl"]`` in
:mod:`odc_accelerate._compat`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .. import check_signature, import_attr, require, warn_if_untested
from . import _LIBRARY, _reference_preparer, is_vision_dataset

__all__ = [
    "KTO_PER_MICROBATCH",
    "check_kto",
    "kto_gathers",
    "is_vision_dataset",
    "kto_reference_preparer",
    "policy_kl_logps",
    "reference_kl_logps",
    "step_kl_answers",
]

#: The metrics KTOTrainer appends per microbatch (the ODC trainer replaces them with one value per step).
KTO_PER_MICROBATCH = (
    "kl",
    "entropy",
    "logits/chosen",
    "logits/rejected",
    "rewards/chosen",
    "logps/chosen",
    "rewards/rejected",
    "logps/rejected",
    "rewards/margins",
    "aux_loss",
)

_COUNTS = ("num_chosen", "num_rejected")


def kto_gathers(trainer: Any, chosen: bool, rejected: bool) -> tuple[str, ...]:
    """What ``KTOTrainer._compute_loss`` passes to ``gather_for_metrics`` in one training microbatch, in call order,
    when the step's gathered counts of chosen / rejected examples are above 0 (``chosen`` / ``rejected``)."""
    names = ("kl",) if trainer.calculate_KL else ()
    names += ("entropy_sum", "entropy_tokens", "num_tokens")
    names += ("chosen_logits_sum", "chosen_tokens", "rejected_logits_sum", "rejected_tokens", *_COUNTS)
    names += ("rewards/chosen", "logps/chosen") if chosen else ()
    names += ("rewards/rejected", "logps/rejected") if rejected else ()
    return names + (("aux_loss",) if trainer.aux_loss_enabled else ())


def check_kto(trainer: Any) -> None:
    """Raise `~odc_accelerate._compat.CompatError` if the KTO trainer lacks an internal the ODC trainer reads or
    patches."""
    warn_if_untested(
        _LIBRARY,
        "odc_accelerate computes KTO's KL estimate with KTOTrainer._compute_kl_logps and reads its metric gathers in "
        "the order of the tested versions; if TRL changed them, the loss or the logged KTO metrics may be wrong.",
    )
    for attr in (
        "_metrics",
        "_total_train_tokens",
        "aux_loss_enabled",
        "calculate_KL",
        "precompute_ref_logps",
        "ref_model",
        "_is_vision_dataset",
    ):
        require(trainer, attr, library=_LIBRARY, where="trl.KTOTrainer")
    kl = require(type(trainer), "_compute_kl_logps", library=_LIBRARY, where="trl.KTOTrainer")
    check_signature(kl, ("model", "batch"), library=_LIBRARY, where="trl.KTOTrainer._compute_kl_logps")


@contextlib.contextmanager
def kto_reference_preparer(prepare: Any) -> Iterator[None]:
    """Within the block, KTOTrainer prepares its reference model under FSDP with ``prepare(model, accelerator,
    trl_prepare)`` instead of TRL's ``prepare_fsdp`` (see `odc_accelerate._compat.trl.dpo.dpo_reference_preparer`)."""
    from trl.trainer import kto_trainer

    with _reference_preparer(kto_trainer, "trl.trainer.kto_trainer", prepare):
        yield


def policy_kl_logps(trainer: Any, batch: dict[str, Any]) -> torch.Tensor:
    """The policy's log-probs of a microbatch's KL sequences, without gradient (``KTOTrainer._compute_kl_logps``)."""
    return trainer._compute_kl_logps(trainer.model, batch)


def reference_kl_logps(trainer: Any, batch: dict[str, Any]) -> torch.Tensor:
    """The reference log-probs of a microbatch's KL sequences, as ``KTOTrainer._compute_loss`` gets them: the
    precomputed column, the reference model, or (PEFT without a reference model) the policy with its adapter off."""
    if trainer.precompute_ref_logps:
        return batch["ref_KL_logps"]
    where = "trl.trainer.kto_trainer"
    disable_checkpointing = import_attr(where, "disable_gradient_checkpointing", library=_LIBRARY)
    is_peft_model = import_attr(where, "is_peft_model", library=_LIBRARY)
    with torch.no_grad(), disable_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
        if is_peft_model(trainer.model) and trainer.ref_model is None:
            use_adapter = import_attr(where, "use_adapter", library=_LIBRARY)
            unwrapped = trainer.accelerator.unwrap_model(trainer.model)
            with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                return trainer._compute_kl_logps(trainer.model, batch)
        return trainer._compute_kl_logps(trainer.ref_model, batch)


@contextlib.contextmanager
def step_kl_answers(trainer: Any, kl: float, num_chosen: float, num_rejected: float) -> Iterator[None]:
    """Within the block (one microbatch's ``KTOTrainer._compute_loss`` under an ODC plan), TRL's KL estimate is the
    step's ``kl`` and its gathered example counts are the step's.

    ``_compute_kl_logps`` answers ``kl`` for its first call (the policy) and 0 for the next (the reference), so that
    TRL's ``(KL_logps - ref_KL_logps).mean()`` is the step's estimate and no KL forward runs in the microbatch (the
    step's pass ran them); a precomputed ``ref_KL_logps`` column must be zeroed by the caller. The ``num_chosen`` /
    ``num_rejected`` gathers (answered with this rank's values by the step's deferred gather, which still records
    them) return the step's global counts, so that every microbatch of every rank makes the same gathers.
    """
    calls = {"kl": 0, "gathers": 0}
    names = kto_gathers(trainer, chosen=num_chosen > 0, rejected=num_rejected > 0)
    answers = {names.index("num_chosen"): num_chosen, names.index("num_rejected"): num_rejected}
    accelerator = trainer.accelerator
    gather = accelerator.gather_for_metrics

    def compute_kl_logps(model: Any, batch: dict[str, Any]) -> torch.Tensor:
        value = kl if calls["kl"] == 0 else 0.0
        calls["kl"] += 1
        return torch.full((1,), value, dtype=torch.float32, device=batch["input_ids"].device)

    def gather_for_metrics(value: Any, *args: Any, **kwargs: Any) -> Any:
        out = gather(value, *args, **kwargs)
        index = calls["gathers"]
        calls["gathers"] += 1
        if index in answers:
            return torch.full_like(torch.as_tensor(out).reshape(-1)[:1], answers[index])
        return out

    trainer._compute_kl_logps = compute_kl_logps
    accelerator.gather_for_metrics = gather_for_metrics
    try:
        yield
    finally:
        del trainer._compute_kl_logps
        accelerator.gather_for_metrics = gather
