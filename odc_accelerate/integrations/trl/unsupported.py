"""The refusal of a TRL trainer ODC does not serve: a run that asks for ODC stops before training with the reason
(`unsupported_trainer_message`), and so does `odc_accelerate.ODCTrainerMixin` put on such a trainer, in any launch
(`check_mixin_trainer`). The trainers served and refused, and why, are the rows of `odc_accelerate.trainers`.

The check goes by the names of TRL's classes among the trainer's bases, so a trainer built on top of one of them
(and one imported from where TRL defines it) is refused as well, and no TRL module is imported for it.
"""

from __future__ import annotations

from typing import Any

from ... import trainers

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
SERVED_TRAINERS = {trainer.trl_path: trainer.odc_trainer for trainer in trainers.SERVED_TRAINERS}

#: TRL trainer class name -> why ODC cannot train it exactly.
UNSUPPORTED_TRAINERS = {trainer.trl_trainer: trainer.reason for trainer in trainers.REFUSED_TRAINERS}


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
    refused trainers (`odc_accelerate.trainers.REFUSED_TRAINERS`), a TRL trainer built on a served one (GKD on SFT),
    and a served TRL class under the bare mixin (``class K(ODCTrainerMixin, DPOTrainer)``, without ODC's DPO loss
    weights) are refused.

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
            f"transformers' Trainer and TRL's {trainers.served_list('trl_trainer')} (`odc_accelerate.ODCTrainer`, "
            f"{trainers.served_list('odc_trainer', quote='`', last='or')}, or a subclass of one); to train "
            f"{base.__name__}, drop ODCTrainerMixin from the bases and {PLAIN_FSDP2}."
        )
