"""Stand-ins for device streams and events on CPU: they run nothing and log what was asked of them.

`FakeStreams` is a ``current_stream`` function for `odc_accelerate.engine.streams.LocalAddFence`: it returns the stream
named by its ``current`` attribute (a test switches it, as FSDP2 switches to its reduce-scatter stream), and every
``record_event``, ``wait_event`` and ``synchronize`` goes into ``log`` as ``(what, stream, event id)``. ``mark`` adds
the test's own entries (e.g. a read of a contribution) to the same log, so that their order can be checked.
"""

from __future__ import annotations

import itertools


class FakeEvent:
    def __init__(self, streams: FakeStreams, stream: str, ident: int) -> None:
        self._streams, self.stream, self.ident = streams, stream, ident

    def synchronize(self) -> None:
        self._streams.log.append(("synchronize", self.stream, self.ident))


class FakeStream:
    def __init__(self, streams: FakeStreams, name: str) -> None:
        self._streams, self.name = streams, name

    def record_event(self) -> FakeEvent:
        event = FakeEvent(self._streams, self.name, next(self._streams._ids))
        self._streams.log.append(("record", self.name, event.ident))
        return event

    def wait_event(self, event: FakeEvent) -> None:
        self._streams.log.append(("wait", self.name, event.ident))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


class FakeStreams:
    def __init__(self, current: str = "default") -> None:
        self.current = current
        self.log: list[tuple] = []
        self._ids = itertools.count()

    def __call__(self) -> FakeStream:
        return FakeStream(self, self.current)

    def mark(self, *entry: object) -> None:
        self.log.append(entry)
