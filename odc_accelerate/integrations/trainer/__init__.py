"""ODC for the transformers `Trainer`: `ODCTrainerMixin` and `ODCCallback`.

Use as ``class MyTrainer(ODCTrainerMixin, Trainer)`` (or the TRL trainers of `odc_accelerate.integrations.trl`).

* `mixin`: the mixin (accelerator set-up, balanced step loop, exact loss, checkpoints).
* `callback`: closes each ODC step after the optimizer.
* `metrics`: metric gathers answered locally during microbatches and reduced once per step; per-step timing.
* `data`: the dataloader whose items are whole steps (a rank's microbatches).
"""

from .callback import ODCCallback
from .mixin import ODCTrainerMixin

__all__ = ["ODCCallback", "ODCTrainerMixin"]
