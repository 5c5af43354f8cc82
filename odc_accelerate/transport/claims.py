"""Claim counters for the ``dynamic`` plan: ranks take a step's microbatches one at a time, as they become free.

A free rank claims the next unclaimed microbatch of the step's list (the same on every rank) with an atomic
fetch-and-add and runs it; past the end of the list it goes to the barrier. Claims make no ``torch.distributed`` call.
The counter lives in the transport (``shm``/``cuda``: rank 0's header; ``network``/``hierarchical``: rank 0's service),
else in the ``torch.distributed`` store (`StoreClaimCounter`). A rank that dies after claiming is named at the next
barrier: the step is lost, never silently short. See docs/planning.md.
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
