"""Time spent in plain FSDP2's collectives, for comparing FSDP2 with ODC on the same per-rank busy/wait footing.

ODC's engine times its own step-boundary waits (`ODCEngine.last_step_stats`). Plain FSDP2 waits inside its per-layer
all-gathers and reduce-scatters, which run asynchronously and are waited on deep inside FSDP2; the only public place
to see them is FSDP2's custom-comm API. `CollectiveTimer` installs, on every FSDP2 module, a wrapper around the comm
FSDP2 already uses that runs it synchronously (``async_op=False``) and adds the time spent to a counter.

Measurement, not training: running the collectives synchronously removes FSDP2's overlap of the next layer's
all-gather with the current layer's compute. On CPU (gloo, one compute thread per rank) there is little such overlap
to lose, which is why the end-to-end benchmark (`python -m odc_accelerate.bench sft`) enables the timer on every
FSDP2 arm (``ODC_TIME_COLLECTIVES=1``); on GPUs the timed run is slower than an untimed one.
"""

from __future__ import annotations

import time
from typing import Any

import torch.nn as nn

from . import _fsdp_compat as compat

__all__ = ["CollectiveTimer"]


class _TimedComm:
    """Wraps one FSDP2 comm object (all-gather or reduce-scatter): same allocation, synchronous call, timed."""

    def __init__(self, inner: Any, timer: CollectiveTimer) -> None:
        self.inner, self.timer = inner, timer

    def allocate(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["async_op"] = False
        start = time.perf_counter()
        work = self.inner(*args, **kwargs)
        if work is not None:  # a backend may still hand back a Work object
            work.wait()
        self.timer.seconds += time.perf_counter() - start
        self.timer.calls += 1
        return None


class CollectiveTimer:
    """Counts the seconds this rank spends in FSDP2's all-gathers and reduce-scatters.

    Args:
        model (`torch.nn.Module`): the ROOT module returned by ``fully_shard``.

    Example:

    ```python
    timer = CollectiveTimer(model)
    ...  # one optimizer step
    waited = timer.take()  # seconds since the last take()
    timer.close()  # FSDP2's own comms again
    ```
    """

    def __init__(self, model: nn.Module) -> None:
        if not compat.is_fsdp2(model):
            raise TypeError(f"CollectiveTimer needs an FSDP2 model (fully_shard), got {type(model).__name__}")
        self.seconds = 0.0
        self.calls = 0
        self._saved: list[tuple[Any, tuple[Any, Any]]] = []
        for _module, state in compat.all_states(model):
            for group in compat.param_groups(state):
                all_gather, reduce_scatter = compat.get_comms(group)
                self._saved.append((group, (all_gather, reduce_scatter)))
                compat.set_comms(group, _TimedComm(all_gather, self), _TimedComm(reduce_scatter, self))

    def take(self) -> float:
        """Seconds spent in collectives since the previous call (or since construction)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def close(self) -> None:
        """Put FSDP2's original comm objects back. Idempotent."""
        for group, comms in self._saved:
            compat.set_comms(group, *comms)
        self._saved = []
