"""Stream order of the ordered reduction's local adds (GPU): the engine waits for its own work, not FSDP2's.

Under ``ordered`` the reduce-scatter hook adds each microbatch's rows into this rank's contributions
(``c<i>/to<o>``). FSDP2 calls that hook on its reduce-scatter stream, so the adds are queued there; the engine then
sums the contributions at ``pre_optimizer_step`` (peers read them after the step's barrier) and zeroes them after
``post_optimizer_step``, both on the current stream. Nothing in the engine may rely on FSDP2 making one stream wait
for the other (it does so in ``finalize_backward`` today), so `LocalAddFence` records an event after every add on
the stream it ran on and waits for those events before the barrier, and makes the next add's stream wait for the
zeroing. On CPU there are no streams and it does nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LocalAddFence", "current_stream_of"]


def current_stream_of(device: torch.device) -> Callable[[], Any] | None:
    """A function returning ``device``'s current stream, or None where the device has no streams (CPU)."""
    if device.type == "cpu":
        return None
    return lambda: torch.accelerator.current_stream(device)


class LocalAddFence:
    """Events around this rank's local adds into its contributions (see the module docstring).

    Args:
        current_stream (`Callable[[], stream]`, *optional*): returns the current stream, whose ``record_event()``
            returns an event with ``synchronize()`` and whose ``wait_event(event)`` orders it after an event
            (`torch.Stream` / `torch.Event`). None: no streams, every method returns at once.
    """

    def __init__(self, current_stream: Callable[[], Any] | None) -> None:
        self._current_stream = current_stream
        self._adds: dict[Any, Any] = {}  # stream -> event after its latest add since the last wait
        self._zeroed: Any = None  # event after the latest zeroing of the contributions

    def before_add(self) -> None:
        """Order the coming add after the latest zeroing (made on another stream, after the previous step)."""
        if self._current_stream is not None and self._zeroed is not None:
            self._current_stream().wait_event(self._zeroed)

    def after_add(self) -> None:
        """Record an event after the add just queued, on the stream it was queued on."""
        if self._current_stream is not None:
            stream = self._current_stream()
            self._adds[stream] = stream.record_event()

    def wait_for_adds(self) -> None:
        """Block until every add recorded since the last call has completed: before peers may read the
        contributions (the step's barrier) and before this rank sums them."""
        adds, self._adds = self._adds, {}
        for event in adds.values():
            event.synchronize()

    def after_zero(self) -> None:
        """Record an event after the contributions were zeroed; the next step's adds wait for it."""
        if self._current_stream is not None:
            self._zeroed = self._current_stream().record_event()
