"""The ``odc-accelerate`` command line.

* ``odc-accelerate launch``: ``accelerate launch`` that honours the ODC keys of the accelerate config file
  (`odc_accelerate.cli.launch`); TRL's own scripts train with ODC under it (`odc_accelerate.cli.bootstrap`).
* ``odc-accelerate config``: write an accelerate config file for FSDP2 + ODC (`odc_accelerate.cli.config`).
* ``odc-accelerate NAME`` for each trainer of `odc_accelerate.trainers` (``sft``, ``dpo``, ...): the package's
  training script (`odc_accelerate.scripts`) under ``accelerate launch``, with the arguments of ``trl NAME`` plus the
  ODC options (`odc_accelerate.cli.training`), and
  ``--accelerate_config odc_cpu|odc_gpu|PATH`` (`odc_accelerate.cli.presets`).
"""

from .main import main

__all__ = ["main"]
