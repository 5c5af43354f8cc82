"""Hierarchical transport: shared memory between ranks of one host, TCP between hosts.

Ranks are grouped by :func:`host_id` (``ODC_HOST_ID``, else host name and boot id). A ``ShmTransport`` over each host's
ranks holds their buffers; a ``NetworkTransport`` over all ranks serves the same buffers to other hosts and gives the
one barrier and ``claim``. Adds into a buffer take a per-buffer thread lock, then the shm record lock (record locks
belong to a process, not a thread). See docs/transports.md, "Protocol details".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

import torch
import torch.distributed as dist

from .base import BufferSpec, Transport, host_id
from .network import NetworkTransport
from .shm import ShmTransport

logger = logging.getLogger(__name__)


#: environment variable that overrides :func:`host_id`
def gather_hosts(group: dist.ProcessGroup | None, world_size: int) -> list[str]:
    """Collective: every rank's :func:`host_id`, indexed by rank in ``group``."""
    hosts: list[str] = [""] * world_size
    dist.all_gather_object(hosts, host_id(), group=group)
    return hosts


def host_layout(hosts: list[str]) -> list[list[int]]:
    """Ranks grouped by host, hosts in order of their lowest rank (the same on every rank)."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    return list(by_host.values())


class HierarchicalTransport(Transport):
    """Shared memory within a host, TCP across hosts, one barrier over all ranks.

    Args:
        rank (`int`): this rank (in ``group``).
        world_size (`int`): number of ranks.
        timeout (`float`, *optional*, defaults to 600.0): seconds any wait may last.
        group (`torch.distributed.ProcessGroup`, *optional*): the ODC group; used only inside ``register``
            (host discovery, one sub-group per multi-rank host, address exchange). Defaults to the world group.
        address (`str`, *optional*): IPv4 address for this rank's network service (see
            :class:`~odc_accelerate.transport.network.NetworkTransport`).
    """

    name = "hierarchical"
    devices = ("cpu",)
    spans_hosts = True
    adds_atomically = True  # as its parts: a record lock within a host, the owner's service thread across hosts

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout: float = 600.0,
        group: dist.ProcessGroup | None = None,
        address: str | None = None,
    ) -> None:
        super().__init__(rank, world_size, timeout)
        self._group = group
        self._address = address
        self._shm: ShmTransport | None = None
        self._net: NetworkTransport | None = None
        self._local: dict[int, int] = {}  # global rank on this host -> rank in the shm sub-group
        self._thread_locks: dict[str, threading.Lock] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self.hosts: list[list[int]] = []
        self._closed = False

    @property
    def job_id(self) -> str | None:
        return self._net.job_id if self._net is not None else None

    def register(self, specs: Mapping[str, BufferSpec]) -> dict[str, torch.Tensor]:
        if self._net is not None:
            raise RuntimeError("HierarchicalTransport.register may be called only once")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("HierarchicalTransport.register needs an initialised torch.distributed process group")
        self.hosts = host_layout(gather_hosts(self._group, self.world_size))
        mine = next(ranks for ranks in self.hosts if self.rank in ranks)
        if len(mine) > 1:
            # Only this host's ranks take part in creating its group (the others may not even be in the world).
            subgroup = dist.new_group(ranks=[self._global_rank(r) for r in mine], use_local_synchronization=True)
            self._local = {r: i for i, r in enumerate(mine)}
            self._shm = ShmTransport(self._local[self.rank], len(mine), timeout=self.timeout, group=subgroup)
            buffers = self._shm.register(specs)
        else:
            self._local = {self.rank: 0}
            buffers = {name: torch.zeros(spec.numel, dtype=spec.dtype) for name, spec in specs.items()}
        self._buffers = buffers
        self._thread_locks = {name: threading.Lock() for name in specs}
        self._net = NetworkTransport(
            self.rank, self.world_size, timeout=self.timeout, group=self._group, address=self._address
        )
        self._net.serve(specs, buffers, add=self._add_own)
        logger.info(
            "hierarchical transport up: rank %d/%d, %d host(s) %s, shared memory with ranks %s",
            self.rank,
            self.world_size,
            len(self.hosts),
            self.hosts,
            mine,
        )
        return dict(buffers)

    def _global_rank(self, rank: int) -> int:
        return rank if self._group is None else dist.get_global_rank(self._group, rank)

    def _add_own(self, name: str, offset: int, src: torch.Tensor) -> None:
        """Add into this rank's own buffer from the training thread or the network service thread."""
        dst = self._buffers[name][offset : offset + src.numel()]
        with self._thread_locks[name]:
            if self._shm is None:
                dst.add_(src)
                return
            # The record lock orders us against local peers; the thread lock above against our own service thread
            # (record locks belong to the process, so they cannot tell our two threads apart).
            self._shm.accumulate(self._shm.rank, name, src, offset=offset)

    # ------------------------------------------------------------- data path
    def read(self, peer: int, name: str, out: torch.Tensor) -> None:
        local = self._local.get(peer)
        if local is not None and self._shm is not None:
            self._shm.read(local, name, out)
        elif peer == self.rank:
            out.copy_(self._buffers[name].view(out.shape))
        else:
            self._net.read(peer, name, out)

    def accumulate(self, owner: int, name: str, src: torch.Tensor) -> None:
        if owner == self.rank:
            self._add_own(name, 0, src.reshape(-1))
        elif owner in self._local:
            self._shm.accumulate(self._local[owner], name, src)
        else:
            self._net.accumulate(owner, name, src)

    has_claims = True

    def claim(self, round: int) -> int:
        """The network transport's claim (served by rank 0 for every host): one counter over all ranks."""
        return self._net.claim(round)

    def barrier(self) -> None:
        self._net.barrier()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Network first: its service thread may still be adding into shared memory.
        if self._net is not None:
            self._net.close()
        if self._shm is not None:
            self._shm.close()
