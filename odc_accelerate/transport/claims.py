"""Claim counters for the ``dynamic`` plan: ranks take a step's microbatches one at a time, as they become free.

Every rank knows the step's list of microbatches (the same list everywhere, costliest first). A rank that is free
claims the next unclaimed one with an atomic fetch-and-add on the step's counter and runs it; when the counter has
passed the end of the list the rank goes to the step's barrier. Each microbatch is run exactly once, by whichever rank
was free first, so a cost model's error or a slower device is absorbed while the step runs. Claims make no
``torch.distributed`` call: no rank waits for another to claim.

Where the counter lives:

=================  ==============================================================================================
``shm``, ``cuda``  a word of rank 0's shared-memory header, read and bumped under a POSIX record lock
``network``        rank 0's service thread, under one lock; ``hierarchical``: the same, over all hosts
anything else      the ``torch.distributed`` store (``Store.add``), `StoreClaimCounter`
=================  ==============================================================================================

A rank that dies after claiming leaves its microbatch unrun: its peers' next barrier names it
(`~odc_accelerate.transport.ODCTimeoutError`) and the step is lost, never silently short.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any, Protocol

import torch.distributed as dist

from .base import ODCTimeoutError, Transport

__all__ = ["ClaimCounter", "StoreClaimCounter", "claim_counter", "claim_indices"]


class ClaimCounter(Protocol):
    """Anything with ``claim(round) -> int`` as `Transport.claim` defines it (a transport with ``has_claims``, or
    `StoreClaimCounter`)."""

    def claim(self, round: int) -> int: ...


class StoreClaimCounter:
    """Claims through a ``torch.distributed`` store: ``Store.add`` is atomic on the store's server.

    One key per round (``<prefix>/<round>``); rank 0 deletes the previous round's key at its first claim of a round
    (every rank finished claiming it before the barrier in between). Every claim is a round trip to the store's server
    (rank 0's process or the launcher's agent), so transports with their own counter do not use this.

    Args:
        store (`torch.distributed.Store`): the store, e.g. the default process group's.
        prefix (`str`): keys' prefix, the same on every rank and unique to this counter (see `claim_counter`).
        rank (`int`): this rank.
    """

    def __init__(self, store: Any, prefix: str, rank: int) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self._last_round = 0

    def claim(self, round: int) -> int:
        if not 0 < round < 2**31:
            raise ValueError(f"claim round must be in [1, 2**31), got {round}")
        try:
            if self.rank == 0 and self._last_round and round != self._last_round:
                self.store.delete_key(f"{self.prefix}/{self._last_round}")
            self._last_round = round
            return int(self.store.add(f"{self.prefix}/{round}", 1)) - 1
        except RuntimeError as err:  # torch raises RuntimeError (DistStoreError) for an unreachable or timed-out store
            raise ODCTimeoutError(
                f"rank {self.rank} could not claim a microbatch from the torch.distributed store ({err}); the store's "
                "server (rank 0 or the launcher) may have died; the optimizer step is lost",
                [0],
            ) from err


def claim_counter(transport: Transport | None, group: dist.ProcessGroup | None = None) -> ClaimCounter:
    """The claim counter for ``transport``: its own where it has one, else the store fallback.

    Collective when it falls back (one broadcast over ``group`` agrees on the keys' prefix), so call it on every rank at
    set-up, never inside a step.

    Args:
        transport (`Transport`, *optional*): the ODC transport; `None` (no ODC) uses the store.
        group (`torch.distributed.ProcessGroup`, *optional*): the ranks that claim; defaults to the world group.
    """
    if transport is not None and transport.has_claims:
        return transport
    from .._compat.torch import c10d as compat

    prefix = [f"odc_claims/{uuid.uuid4().hex[:16]}"]
    dist.broadcast_object_list(prefix, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return StoreClaimCounter(compat.default_store(), prefix[0], dist.get_rank(group))


def claim_indices(counter: ClaimCounter, round: int, count: int) -> Iterator[int]:
    """Yield the indices in ``[0, count)`` this rank claims in ``round``, one claim per index, until none is left.

    Claim the next index only when the previous one's work is done (iterate lazily): an index claimed early is one a
    free rank cannot take.
    """
    while True:
        index = counter.claim(round)
        if index >= count:
            return
        yield index
