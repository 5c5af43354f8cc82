"""A watchdog for set-up calls that have no timeout: symmetric memory's allocation and rendezvous.

``empty_strided_p2p`` and ``rendezvous`` block inside C++ until every rank of the group arrives. A rank that fails
there (out of GPU memory, a socket error) or before it leaves its peers blocked forever, and Python cannot interrupt
the blocked call. So each rank writes how far it got (its *phase*) into the control plane's shared memory, and a
thread on every rank watches the peers' phases and pids while the calls run. When a peer failed or died, or nothing
finished within the transport's timeout, it reports which rank is where and ends the process (status 1): the only
way out of a call that cannot be interrupted, and what lets the launcher stop the job instead of leaving it hanging.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

FAILED, OUT_OF_MEMORY = -1, -2
CONTROL_UP, ALLOCATING, ALLOCATED, RENDEZVOUS, MAPPED = 0, 1, 2, 3, 4
PHASES = {
    FAILED: "failed (see its own error)",
    OUT_OF_MEMORY: "ran out of GPU memory allocating its segment (every rank refuses)",
    CONTROL_UP: "has not started allocating its segment",
    ALLOCATING: "allocating its segment (symmetric memory, empty_strided_p2p)",
    ALLOCATED: "allocated its segment, waiting for the peers to allocate theirs",
    RENDEZVOUS: "in the symmetric-memory rendezvous",
    MAPPED: "mapped every peer's segment",
}


def exit_stuck(message: str) -> None:
    """Write ``message`` to stderr (and to the log where one is configured) and end the process with status 1: the
    blocked call cannot be interrupted."""
    if logger.hasHandlers():  # without handlers, logging's last resort would print it to stderr a second time
        logger.critical(message)
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


class SetupWatchdog:
    """Watch the peers of a blocking set-up call; call ``on_stuck`` with a message naming the ranks at fault.

    Use as a context manager around the blocking calls; leaving it stops the thread.

    Args:
        rank (`int`): this rank.
        world_size (`int`): number of ranks.
        timeout (`float`): seconds the guarded calls may take in all.
        phase_of (`Callable[[int], int]`): the phase a rank last wrote (readable for every rank, this one included).
        dead_peers (`Callable[[], Sequence[int]]`): the peers whose processes no longer run.
        on_stuck (`Callable[[str], None]`, *optional*, defaults to `exit_stuck`): what to do with the message.
        poll_s (`float`, *optional*, defaults to 0.2): seconds between looks at the peers.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout: float,
        phase_of: Callable[[int], int],
        dead_peers: Callable[[], Sequence[int]],
        on_stuck: Callable[[str], None] = exit_stuck,
        poll_s: float = 0.2,
    ) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._phase_of, self._dead_peers, self._on_stuck, self._poll_s = phase_of, dead_peers, on_stuck, poll_s
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SetupWatchdog:
        self._thread = threading.Thread(target=self._watch, name="odc-setup-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        deadline = time.monotonic() + self.timeout
        while not self._done.wait(self._poll_s):
            phases = [self._phase_of(r) for r in range(self.world_size)]
            failed = [r for r, p in enumerate(phases) if p == FAILED and r != self.rank]
            dead = [r for r in self._dead_peers() if r != self.rank]
            if failed or dead:
                cause = "; ".join(
                    [f"rank {r} failed during the 'cuda' transport's set-up" for r in failed]
                    + [f"rank {r} exited during the 'cuda' transport's set-up" for r in dead if r not in failed]
                )
            elif time.monotonic() >= deadline:
                # The ranks furthest behind are the ones the others wait for.
                behind = [r for r, p in enumerate(phases) if p == min(phases)]
                cause = f"the set-up did not finish within {self.timeout:g}s; furthest behind: rank(s) {behind}"
            else:
                continue
            if self._done.is_set():  # finished meanwhile: nothing is stuck
                return
            where = ", ".join(f"rank {r} {PHASES.get(p, f'phase {p}')}" for r, p in enumerate(phases))
            self._on_stuck(
                f"ODC 'cuda' transport on rank {self.rank}: {cause}. Where each rank is: {where}. This rank is blocked "
                "in a symmetric-memory call that cannot be interrupted, so it exits (status 1) instead of waiting "
                "forever; the first error above, on the rank named, says what to fix (e.g. out of GPU memory)."
            )
            return
