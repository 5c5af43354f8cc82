"""ODC for TRL: the SFT, DPO, GRPO, reward-model and RLOO trainers and their training arguments (``--odc true`` and
friends).

One module per trainer (`sft`, `dpo`, `grpo`, `reward`, `rloo`) and per shared concern (`config`, `online`,
`grpo_checks`, `unsupported`, `reference`, `metrics`, `rollouts`, `loss`); TRL's internals are in
`odc_accelerate._compat.trl`. Names are imported on first use, so that an SFT run does not import TRL's GRPO trainer.
Usage and what each trainer changes: docs/integrations.md.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

__all__ = [
    "ODCDPOConfig",
    "ODCDPOTrainer",
    "ODCGRPOConfig",
    "ODCGRPOTrainer",
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
    from .reward import ODCRewardTrainer
    from .rloo import ODCRLOOTrainer
    from .sft import ODCSFTTrainer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
