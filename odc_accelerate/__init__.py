"""On-Demand Communication (ODC) for FSDP2 and Hugging Face training.

Public API. Names are imported lazily so that `import odc_accelerate` stays cheap (the planner
and sampler need no torch.distributed set-up).
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0.dev0"

_LAZY = {
    "ODCConfig": "odc_accelerate.config",
    "ODCEngine": "odc_accelerate.engine",
    "ODCTimeoutError": "odc_accelerate.transport.base",
    "loss_scale": "odc_accelerate.loss",
    "LengthBalancedBatchSampler": "odc_accelerate.planning",
    "PlanName": "odc_accelerate.planning",
    "ReductionName": "odc_accelerate.reduction",
    "plan_step": "odc_accelerate.planning",
    # Hugging Face integrations (importing them patches nothing; see `odc_accelerate.integrations.accelerate.enable`)
    "ODCPlugin": "odc_accelerate.integrations.accelerate",
    "enable": "odc_accelerate.integrations.accelerate",
    "get_engine": "odc_accelerate.integrations.accelerate",
    "ODCTrainer": "odc_accelerate.integrations.trainer",
    "ODCTrainerMixin": "odc_accelerate.integrations.trainer",
    "ODCCallback": "odc_accelerate.integrations.trainer",
    "ODCDPOConfig": "odc_accelerate.integrations.trl",
    "ODCDPOTrainer": "odc_accelerate.integrations.trl",
    "ODCGRPOConfig": "odc_accelerate.integrations.trl",
    "ODCGRPOTrainer": "odc_accelerate.integrations.trl",
    "ODCRewardConfig": "odc_accelerate.integrations.trl",
    "ODCRewardTrainer": "odc_accelerate.integrations.trl",
    "ODCRLOOConfig": "odc_accelerate.integrations.trl",
    "ODCRLOOTrainer": "odc_accelerate.integrations.trl",
    "ODCKTOConfig": "odc_accelerate.integrations.trl",
    "ODCKTOTrainer": "odc_accelerate.integrations.trl",
    "ODCSFTConfig": "odc_accelerate.integrations.trl",
    "ODCSFTTrainer": "odc_accelerate.integrations.trl",
}

__all__ = [
    "LengthBalancedBatchSampler",
    "ODCCallback",
    "ODCConfig",
    "ODCEngine",
    "ODCPlugin",
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
    "ODCTimeoutError",
    "ODCTrainer",
    "ODCTrainerMixin",
    "PlanName",
    "ReductionName",
    "enable",
    "get_engine",
    "loss_scale",
    "plan_step",
]

if TYPE_CHECKING:  # pragma: no cover
    from .config import ODCConfig
    from .engine import ODCEngine
    from .integrations.accelerate import ODCPlugin, enable, get_engine
    from .integrations.trainer import ODCCallback, ODCTrainer, ODCTrainerMixin
    from .integrations.trl import (
        ODCDPOConfig,
        ODCDPOTrainer,
        ODCGRPOConfig,
        ODCGRPOTrainer,
        ODCKTOConfig,
        ODCKTOTrainer,
        ODCRewardConfig,
        ODCRewardTrainer,
        ODCRLOOConfig,
        ODCRLOOTrainer,
        ODCSFTConfig,
        ODCSFTTrainer,
    )
    from .loss import loss_scale
    from .planning import LengthBalancedBatchSampler, PlanName, plan_step
    from .reduction import ReductionName
    from .transport.base import ODCTimeoutError


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'odc_accelerate' has no attribute {name!r}")
