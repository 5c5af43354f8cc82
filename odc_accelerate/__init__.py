"""On-Demand Communication (ODC) for FSDP2 and Hugging Face training.

Public API. Names are imported lazily so that `import odc_accelerate` stays cheap (the planner
and sampler need no torch.distributed set-up).
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0.dev0"

_LAZY = {
    "ODCEngine": "odc_accelerate.engine",
    "ODCTimeoutError": "odc_accelerate.transport.base",
    "loss_scale": "odc_accelerate.loss",
    "LengthBalancedBatchSampler": "odc_accelerate.sampler",
    "plan_step": "odc_accelerate.balance",
}

__all__ = ["LengthBalancedBatchSampler", "ODCEngine", "ODCTimeoutError", "loss_scale", "plan_step"]

if TYPE_CHECKING:  # pragma: no cover
    from .balance import plan_step
    from .engine import ODCEngine
    from .loss import loss_scale
    from .sampler import LengthBalancedBatchSampler
    from .transport.base import ODCTimeoutError


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'odc_accelerate' has no attribute {name!r}")
