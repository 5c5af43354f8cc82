"""`ODCCallback`: the step boundary after the optimizer, and the end of training."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

__all__ = ["ODCCallback"]


class ODCCallback(TrainerCallback):
    """Closes each ODC step after the optimizer (``engine.post_optimizer_step()`` and the step's timing), and the
    collective timer of a timed plain-FSDP2 run when training ends.

    Callbacks do not receive the trainer, so `ODCTrainerMixin` constructs this with itself.

    Args:
        trainer (`ODCTrainerMixin`): the trainer whose steps this closes.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.odc_after_optimizer_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Put torch.distributed's functions and FSDP2's comms back: saving or evaluating after training runs untimed.
        self.trainer.odc_step_timer.close()
