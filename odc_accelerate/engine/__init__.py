"""The ODC engine: FSDP2 with one-sided gathers and scatter-accumulates, synchronised once per optimizer step.

=====================  ==========================================================================================
``engine``             `ODCEngine`: the step lifecycle (gather, scatter-accumulate, barrier, fold, publish, close)
``_setup``             what ``ODCEngine.__init__`` checks and builds: served groups, buffers, hooks, refusals
``_hooks``             the FSDP2 all-gather / reduce-scatter hooks, which hand FSDP2's collectives to the engine
``stats``              `EngineState` and `StepStats`: where the engine is and what a step cost this rank
``memory``             the step memory policy, and every reading of free / peak memory in the package
``model_check``        the set-up checks every rank agrees on (served groups, same model, same optimizer)
``hsdp``               HSDP: the once-per-step all-reduce of gradient shards across replicas
``process_exit``       releasing gloo's process groups at interpreter exit
=====================  ==========================================================================================

Names are imported lazily: the transports read `odc_accelerate.engine.memory`, and the engine itself imports the
transports, so importing this package must not import `ODCEngine`.
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
