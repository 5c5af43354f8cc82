"""ODC for the transformers `Trainer`: `ODCTrainerMixin` and `ODCCallback`.

Use as ``class MyTrainer(ODCTrainerMixin, Trainer)`` (or the TRL trainers of `odc_accelerate.integrations.trl`).

* `mixin`: the mixin, made of one part per concern: `setup` (accelerator, banner), `loaders` and `streaming` (the
  balanced step loaders), `step` (the microbatch loop, exact loss), `resume` (checkpoints);
* `run`: `ODCRun`, what a run derives from its read-only options (samples per step, the chosen token budget);
* `budget`: the token budget per microbatch, one rule for every trainer;
* `callback`: closes each ODC step after the optimizer;
* `metrics`: metric gathers answered locally during microbatches and reduced once per step;
* `timing`: per-step timing behind the ``odc/*`` metrics;
* `data`: the dataloader whose items are whole steps (a rank's microbatches).
"""

from .callback import ODCCallback
from .mixin import ODCTrainerMixin
from .run import ODCRun

__all__ = ["ODCCallback", "ODCRun", "ODCTrainerMixin"]
