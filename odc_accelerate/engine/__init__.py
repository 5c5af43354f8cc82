"""The ODC engine: FSDP2 with one-sided gathers and scatter-accumulates, synchronised once per optimizer step.

``engine`` (`ODCEngine`, the step lifecycle), ``_setup`` (what its ``__init__`` checks and builds), ``_hooks`` (the
FSDP2 all-gather / reduce-scatter hooks), ``stats``, ``memory`` (the step memory policy), ``model_check``, ``hsdp`` and
``process_exit``. Names are imported lazily: the transports read `odc_accelerate.engine.memory`, and the engine imports
the transports, so importing this package must not import `ODCEngine`. See docs/design.md, "The engine".
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

_LAZY = {
    "ODCEngine": "odc_accelerate.engine.engine",
    "EngineState": "odc_accelerate.engine.stats",
    "StepStats": "odc_accelerate.engine.stats",
}

__all__ = ["EngineState", "ODCEngine", "StepStats"]

if TYPE_CHECKING:  # pragma: no cover
    from .engine import ODCEngine
    from .stats import EngineState, StepStats


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'odc_accelerate.engine' has no attribute {name!r}")
