"""`ODCTrainer`: `transformers.Trainer` with ODC (`ODCTrainerMixin` + ``Trainer``).

Under ``odc-accelerate launch`` (a run that asks for ODC) the bootstrap puts this class in place of
``transformers.Trainer`` before the script runs (`odc_accelerate.cli.bootstrap`), so a plain ``Trainer`` script, and a
``class MyTrainer(Trainer)`` it defines, train with ODC unmodified. A script that also writes the mixin in
(``class MyTrainer(ODCTrainerMixin, Trainer)``) keeps working: the class's type drops the mixin it already has from
the bases, where Python could not otherwise order them (the mixin must come first, and ``Trainer`` is now a subclass
of it).
"""

from __future__ import annotations

from typing import Any

from ..._compat import transformers as tcompat
from .mixin import ODCTrainerMixin

__all__ = ["ODCTrainer"]


class _ODCTrainerType(type):
    """The type of `ODCTrainer`: a subclass naming `ODCTrainerMixin` beside a base that already has it is built without
    that repeated base (same methods, same order)."""

    def __new__(mcls, name: str, bases: tuple, namespace: dict[str, Any], **kwargs: Any) -> type:
        if ODCTrainerMixin in bases and any(
            base is not ODCTrainerMixin and isinstance(base, type) and issubclass(base, ODCTrainerMixin)
            for base in bases
        ):
            bases = tuple(base for base in bases if base is not ODCTrainerMixin)
        return super().__new__(mcls, name, bases, namespace, **kwargs)


class ODCTrainer(ODCTrainerMixin, tcompat.original_trainer(), metaclass=_ODCTrainerType):
    """`transformers.Trainer` with ODC: takes the Trainer's arguments; the ODC settings come from ``fsdp_config``'s
    ODC keys or the ``ODC_*`` environment variables (what ``odc-accelerate launch`` exports from the accelerate
    config's ``odc*`` keys), see `ODCTrainerMixin`.

    With a plan, each step's samples are planned by length (the ``input_ids`` column, or ``length``) and collated per
    microbatch by the Trainer's collator; the loss is the Trainer's per-token mean over every label token of the
    step on all ranks, what one process computes on the same samples.

    Example:

    ```python
    from odc_accelerate import ODCTrainer

    trainer = ODCTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    trainer.train()
    ```
    """
