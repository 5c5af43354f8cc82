"""ODC for TRL: the SFT, DPO, GRPO, reward-model, RLOO and KTO trainers and their training arguments (``--odc true`` and
friends).

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

* `config`: the training arguments (`ODCSFTConfig`, `ODCDPOConfig`, `ODCGRPOConfig`, `ODCRewardConfig`,
  `ODCRLOOConfig`);
* `sft`, `dpo`, `grpo`, `reward`, `rloo`: one trainer each; `kto`: KTO's config and trainer;
* `online`: what GRPO and RLOO share: generation without collectives, the step planned from its completions;
* `grpo_checks`: the GRPO / RLOO arguments and vLLM settings ODC refuses;
* `unsupported`: the TRL trainers ODC refuses (distillation, ...), and why;
* `reference`: the reference model of DPO, GRPO and RLOO, served by a gather-only engine;
* `metrics`: TRL's per-microbatch metrics turned into one global value per step;
* `rollouts`: generated completions re-batched per row and per planned microbatch;
* `loss`: the loss weights that make TRL's per-microbatch normalisations exact under unequal work.

TRL's own internals (gather orders, patched functions) are in `odc_accelerate._compat.trl`, one module per trainer as
here. Names are imported on first use, so that an SFT run does not import TRL's GRPO trainer.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

__all__ = [
    "ODCDPOConfig",
    "ODCDPOTrainer",
    "ODCGRPOConfig",
    "ODCGRPOTrainer",
    "ODCKTOConfig",
    "ODCKTOTrainer",
    "ODCRewardConfig",
    "ODCRewardTrainer",
    "ODCRLOOConfig",
    "ODCRLOOTrainer",
    "ODCSFTConfig",
    "ODCSFTTrainer",
    "ODCTrainingArgumentsMixin",
]

_LAZY = {
    "ODCDPOConfig": "config",
    "ODCGRPOConfig": "config",
    "ODCRewardConfig": "config",
    "ODCRLOOConfig": "config",
    "ODCSFTConfig": "config",
    "ODCTrainingArgumentsMixin": "config",
    "ODCDPOTrainer": "dpo",
    "ODCGRPOTrainer": "grpo",
    "ODCRewardTrainer": "reward",
    "ODCRLOOTrainer": "rloo",
    "ODCSFTTrainer": "sft",
    "ODCKTOConfig": "kto",
    "ODCKTOTrainer": "kto",
}

if TYPE_CHECKING:  # pragma: no cover
    from .config import (
        ODCDPOConfig,
        ODCGRPOConfig,
        ODCRewardConfig,
        ODCRLOOConfig,
        ODCSFTConfig,
        ODCTrainingArgumentsMixin,
    )
    from .dpo import ODCDPOTrainer
    from .grpo import ODCGRPOTrainer
    from .kto import ODCKTOConfig, ODCKTOTrainer
    from .reward import ODCRewardTrainer
    from .rloo import ODCRLOOTrainer
    from .sft import ODCSFTTrainer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
