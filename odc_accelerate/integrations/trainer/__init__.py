"""ODC for the transformers `Trainer`: `ODCTrainer`, `ODCTrainerMixin` and `ODCCallback`.

Use `ODCTrainer` in place of ``transformers.Trainer``, or ``class MyTrainer(ODCTrainerMixin, Trainer)`` (or the TRL
trainers of `odc_accelerate.integrations.trl`). The mixin is one module per concern: `setup` (accelerator, banner),
`loaders` and `streaming` (step loaders), `step` (the microbatch loop, exact loss), `resume`; beside it `run`,
`budget` (the token budget), `callback`, `metrics`, `timing` and `data` (the loader whose items are whole steps).
"""

from .callback import ODCCallback
from .mixin import ODCTrainerMixin
from .run import ODCRun
from .trainer import ODCTrainer

__all__ = ["ODCCallback", "ODCRun", "ODCTrainer", "ODCTrainerMixin"]
