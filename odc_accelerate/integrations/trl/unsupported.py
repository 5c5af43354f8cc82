"""The TRL trainers ODC refuses, and why: a run that asks for ODC stops before training with one of these reasons.

Both make a collective inside every microbatch that no local answer can stand in for exactly:

* ``KTOTrainer``: the KL estimate in its loss is ``gather_for_metrics`` of every rank's mean KL at the same
  accumulation index, then averaged (TRL's ``kto_trainer.py``), a value that depends on how the step's examples are
  split over ranks and microbatches. Under ODC ranks run different numbers of microbatches, so the gather would pair
  unrelated microbatches or wait forever, and a local answer would change the loss.
* ``DistillationTrainer``: its loss calls ``full_tensor()`` on the student's sharded ``lm_head`` weight (an
  all-gather) in every microbatch, and its teacher is a second model that FSDP2 does not shard (accelerate neither
  wraps nor moves it), so ODC can serve neither.

The check goes by the names of TRL's classes among the trainer's bases, so a trainer built on top of one of them
(and one imported from where TRL defines it) is refused as well, and neither TRL module is imported for it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PLAIN_FSDP2", "UNSUPPORTED_TRAINERS", "unsupported_trainer_message"]

#: What a refused run can do instead.
PLAIN_FSDP2 = (
    "train it with plain FSDP2 (`odc: false`): set `odc: false` in the accelerate config, or ODC_ENABLE=false"
)

#: TRL trainer class name -> why ODC cannot train it exactly.
UNSUPPORTED_TRAINERS = {
    "KTOTrainer": (
        "its loss uses a KL estimate that is a cross-rank mean: accelerator.gather_for_metrics of every rank's mean KL "
        "at the same gradient-accumulation index, inside every microbatch. With ODC ranks run different numbers of "
        "microbatches, so that collective would pair unrelated microbatches or hang, and the estimate (hence the "
        "loss) depends on how the step is split over ranks and microbatches"
    ),
    "DistillationTrainer": (
        "its loss calls full_tensor() on the student's sharded lm_head weight (an all-gather collective) in every "
        "microbatch, and its teacher model is not sharded by FSDP2, so ODC can serve neither"
    ),
}


def unsupported_trainer_message(trainer: Any) -> str | None:
    """Why ODC refuses ``trainer`` (a trainer instance or class) and what to do instead, or `None` if it is not one of
    `UNSUPPORTED_TRAINERS` (nor built on one)."""
    cls = trainer if isinstance(trainer, type) else type(trainer)
    for base in cls.__mro__:
        if base.__name__ in UNSUPPORTED_TRAINERS and base.__module__.split(".")[0] == "trl":
            name = base.__name__
            shown = name if cls is base else f"{cls.__module__}.{cls.__qualname__} (built on TRL's {name})"
            return (
                f"ODC does not support TRL's {name}: {UNSUPPORTED_TRAINERS[name]}. This run asks for ODC, so {shown} "
                f"was stopped before training: {PLAIN_FSDP2}."
            )
    return None
