"""The TRL trainers ODC serves and refuses, and why: a run that asks for ODC stops before training with one of these
reasons, and so does `odc_accelerate.ODCTrainerMixin` on a TRL trainer it does not serve, in any launch.

ODC serves TRL's SFT, DPO, GRPO, RLOO, reward and KTO trainers through its own classes (`SERVED_TRAINERS`), which weight
each planned microbatch's loss and answer TRL's per-microbatch collectives; any other TRL trainer has a loss and
collectives ODC has not been made for. The refused ones whose reason is known (`UNSUPPORTED_TRAINERS`):

* ``DistillationTrainer``: its loss calls ``full_tensor()`` on the student's sharded ``lm_head`` weight (an
  all-gather) in every microbatch, and its teacher is a second model that FSDP2 does not shard (accelerate neither
  wraps nor moves it), so ODC can serve neither.
* ``ORPOTrainer``, ``CPOTrainer`` (TRL's experimental ones): the loss is a mean over the microbatch's pairs plus a
  mean NLL over its chosen tokens, so under a plan the planned microbatches' means would be summed with no weight.
* ``OnlineDPOTrainer`` (experimental): generates inside every training step with ``gather_object`` of the prompts (a
  collective), and its loss is a mean over the microbatch's pairs.

The check goes by the names of TRL's classes among the trainer's bases, so a trainer built on top of one of them
(and one imported from where TRL defines it) is refused as well, and no TRL module is imported for it.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PLAIN_FSDP2",
    "SERVED_TRAINERS",
    "UNSUPPORTED_TRAINERS",
    "check_mixin_trainer",
    "unsupported_trainer_message",
]

#: What a refused run can do instead.
PLAIN_FSDP2 = (
    "train it with plain FSDP2 (`odc: false`): set `odc: false` in the accelerate config, or ODC_ENABLE=false"
)

#: TRL's trainer classes ODC serves (``module.name`` where TRL defines them) -> the ODC class that serves them.
SERVED_TRAINERS = {
    "trl.trainer.sft_trainer.SFTTrainer": "ODCSFTTrainer",
    "trl.trainer.dpo_trainer.DPOTrainer": "ODCDPOTrainer",
    "trl.trainer.grpo_trainer.GRPOTrainer": "ODCGRPOTrainer",
    "trl.trainer.rloo_trainer.RLOOTrainer": "ODCRLOOTrainer",
    "trl.trainer.reward_trainer.RewardTrainer": "ODCRewardTrainer",
    "trl.trainer.kto_trainer.KTOTrainer": "ODCKTOTrainer",
}

_PER_MICROBATCH_MEAN = (
    "its loss is a mean over the microbatch's pairs plus a mean NLL over its chosen tokens, for which ODC has no "
    "weights: under a plan the planned microbatches' means would be summed, so the loss would depend on the plan"
)

#: TRL trainer class name -> why ODC cannot train it exactly.
UNSUPPORTED_TRAINERS = {
    "DistillationTrainer": (
        "its loss calls full_tensor() on the student's sharded lm_head weight (an all-gather collective) in every "
        "microbatch, and its teacher model is not sharded by FSDP2, so ODC can serve neither"
    ),
    "ORPOTrainer": _PER_MICROBATCH_MEAN,
    "CPOTrainer": _PER_MICROBATCH_MEAN,
    "OnlineDPOTrainer": (
        "it generates completions inside every training step with gather_object of the prompts (a collective that "
        "ranks running different numbers of microbatches would not meet), and its loss is a mean over the "
        "microbatch's pairs, for which ODC has no weights"
    ),
}


def _full_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_trl(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "trl"


def _listed_reason(cls: type) -> tuple[str, str] | None:
    """The TRL class of `UNSUPPORTED_TRAINERS` ``cls`` is (or is built on), and its reason."""
    for base in cls.__mro__:
        if base.__name__ in UNSUPPORTED_TRAINERS and _is_trl(base):
            return base.__name__, UNSUPPORTED_TRAINERS[base.__name__]
    return None


def unsupported_trainer_message(trainer: Any) -> str | None:
    """Why ODC refuses ``trainer`` (a trainer instance or class) and what to do instead, or `None` if it is not one of
    `UNSUPPORTED_TRAINERS` (nor built on one)."""
    cls = trainer if isinstance(trainer, type) else type(trainer)
    listed = _listed_reason(cls)
    if listed is None:
        return None
    name, reason = listed
    shown = name if cls.__name__ == name and _is_trl(cls) else f"{_full_name(cls)} (built on TRL's {name})"
    return f"ODC does not support TRL's {name}: {reason}. This run asks for ODC, so {shown} was stopped before training: {PLAIN_FSDP2}."


def check_mixin_trainer(cls: type, mixin: type) -> None:
    """Refuse a trainer class that puts ``mixin`` (`ODCTrainerMixin`) on a TRL trainer ODC does not serve.

    Every TRL class below ``mixin`` in ``cls``'s MRO must be one of `SERVED_TRAINERS` (or a base of one) whose ODC class
    is in the MRO too: the ODC classes, a subclass of one, and ``transformers.Trainer`` with the mixin pass; TRL's
    ORPO, CPO, online DPO, distillation, ... trainers, a TRL trainer built on a served one (GKD on SFT), and a served TRL class
    under the bare mixin (``class K(ODCTrainerMixin, DPOTrainer)``, without ODC's DPO loss weights) are refused.

    Raises:
        RuntimeError: naming the TRL class, why, and what to use instead.
    """
    mro = cls.__mro__
    below = [base for base in mro[mro.index(mixin) + 1 :] if _is_trl(base)]
    odc_names = {base.__name__ for base in mro if base.__module__.split(".")[0] == "odc_accelerate"}
    served = [base for base in below if SERVED_TRAINERS.get(_full_name(base)) in odc_names]
    for base in below:
        if any(issubclass(ok, base) for ok in served):
            continue
        shown = _full_name(cls)
        odc_class = SERVED_TRAINERS.get(_full_name(base))
        if odc_class is not None:
            raise RuntimeError(
                f"{shown} puts ODCTrainerMixin on TRL's {base.__name__} directly, which ODC serves only through its "
                f"own class (loss weights of the planned microbatches, TRL's collectives answered once per step): "
                f"build it on `odc_accelerate.{odc_class}` instead (`class {cls.__name__}({odc_class})`)."
            )
        listed = _listed_reason(base)
        why = (
            f"ODC does not support TRL's {listed[0]}: {listed[1]}"
            if listed is not None
            else f"ODC has not been made for TRL's {_full_name(base)} (its loss weights and collectives)"
        )
        raise RuntimeError(
            f"{why}. {shown} puts ODCTrainerMixin on it, so it was stopped before training. ODC serves "
            "transformers' Trainer and TRL's SFT, DPO, GRPO, RLOO, reward and KTO trainers (`odc_accelerate.ODCTrainer`, "
            "`ODCSFTTrainer`, `ODCDPOTrainer`, `ODCGRPOTrainer`, `ODCRLOOTrainer`, `ODCRewardTrainer`, `ODCKTOTrainer`, or a subclass "
            f"of one); to train {base.__name__}, drop ODCTrainerMixin from the bases and {PLAIN_FSDP2}."
        )
