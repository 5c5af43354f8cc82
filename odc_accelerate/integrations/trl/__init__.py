"""ODC for TRL: the SFT, DPO, GRPO and RLOO trainers and their training arguments (``--odc true`` and friends).

```python
from odc_accelerate.integrations.trl import ODCSFTConfig, ODCSFTTrainer

args = ODCSFTConfig(output_dir="out", odc=True, odc_max_tokens_per_microbatch=4096)
trainer = ODCSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
trainer.train()
trainer.end()  # closes the ODC engine and destroys the process group
```

The ODC fields parse from the command line (``--odc true --odc_plan lockstep``) and from a TRL ``--config
recipe.yaml``; the same keys in ``--fsdp_config file.json`` work too (see `odc_accelerate.config.ODCConfig`).

One module per concern:

* `config`: the training arguments (`ODCSFTConfig`, `ODCDPOConfig`, `ODCGRPOConfig`, `ODCRLOOConfig`);
* `sft`, `dpo`, `grpo`, `rloo`: one trainer each;
* `online`: what GRPO and RLOO share: generation without collectives, the step planned from its completions;
* `reference`: the reference model of DPO, GRPO and RLOO, served by a gather-only engine;
* `metrics`: TRL's per-microbatch metrics turned into one global value per step;
* `rollouts`: generated completions re-batched per row and per planned microbatch;
* `loss`: the loss weights that make TRL's per-microbatch normalisations exact under unequal work.

TRL's own internals (gather orders, patched functions) are in `odc_accelerate._compat.trl` (RLOO's in
`odc_accelerate._compat.trl_rloo`). Names are imported on
first use, so that an SFT run does not import TRL's GRPO trainer.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

__all__ = [
    "ODCDPOConfig",
    "ODCDPOTrainer",
    "ODCGRPOConfig",
    "ODCGRPOTrainer",
    "ODCRLOOConfig",
    "ODCRLOOTrainer",
    "ODCSFTConfig",
    "ODCSFTTrainer",
    "ODCTrainingArgumentsMixin",
]

_LAZY = {
    "ODCDPOConfig": "config",
    "ODCGRPOConfig": "config",
    "ODCRLOOConfig": "config",
    "ODCSFTConfig": "config",
    "ODCTrainingArgumentsMixin": "config",
    "ODCDPOTrainer": "dpo",
    "ODCGRPOTrainer": "grpo",
    "ODCRLOOTrainer": "rloo",
    "ODCSFTTrainer": "sft",
}

if TYPE_CHECKING:  # pragma: no cover
    from .config import ODCDPOConfig, ODCGRPOConfig, ODCRLOOConfig, ODCSFTConfig, ODCTrainingArgumentsMixin
    from .dpo import ODCDPOTrainer
    from .grpo import ODCGRPOTrainer
    from .rloo import ODCRLOOTrainer
    from .sft import ODCSFTTrainer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
