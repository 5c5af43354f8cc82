"""On-Demand Communication (ODC) for FSDP2 and Hugging Face training.

Public API. Names are imported lazily so that `import odc_accelerate` stays cheap (the planner
and sampler need no torch.distributed set-up).
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from . import trainers

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
}
# Each TRL trainer's config and trainer (`odc_accelerate.trainers`).
_LAZY.update(
    {
        name: "odc_accelerate.integrations.trl"
        for t in trainers.SERVED_TRAINERS
        for name in (t.odc_config, t.odc_trainer)
    }
)

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # pragma: no cover  (for type checkers; __all__ is built from _LAZY)
    from .config import ODCConfig  # noqa: F401
    from .engine import ODCEngine  # noqa: F401
    from .integrations.accelerate import ODCPlugin, enable, get_engine  # noqa: F401
    from .integrations.trainer import ODCCallback, ODCTrainer, ODCTrainerMixin  # noqa: F401
    from .integrations.trl import (  # noqa: F401
        ODCDistillationConfig,
        ODCDistillationTrainer,
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
    from .loss import loss_scale  # noqa: F401
    from .planning import LengthBalancedBatchSampler, PlanName, plan_step  # noqa: F401
    from .reduction import ReductionName  # noqa: F401
    from .transport.base import ODCTimeoutError  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'odc_accelerate' has no attribute {name!r}")
