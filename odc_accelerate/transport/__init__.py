"""Transports: how ranks read each other's shards and add into each other's gradient accumulators.

=================  ==================================================================================
``"shm"``          CPU tensors, every rank on one host: ``/dev/shm`` mappings and record locks.
``"network"``      CPU tensors, any hosts: TCP with an owner-side service thread per rank.
``"hierarchical"`` CPU tensors, several hosts: ``"shm"`` within a host, ``"network"`` across hosts.
``"cuda"``         CUDA tensors, one node: torch symmetric memory (CUDA IPC), atomic adds into fp32 accumulators.
``"auto"``         picks one of the above (`choose_transport`) and logs the choice.
=================  ==================================================================================

Each transport's facts are class attributes of its `Transport`; `TRANSPORT_CLASSES` maps names to classes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .auto import TransportChoice, choose_transport
from .base import HOST_ID_ENV, BufferSpec, ODCTimeoutError, Transport, host_id
from .cuda import CudaTransport
from .hierarchical import HierarchicalTransport
from .network import NetworkTransport
from .registry import TRANSPORT_CLASSES, TRANSPORTS
from .shm import ShmTransport

__all__ = [
    "BufferSpec",
    "CudaTransport",
    "HOST_ID_ENV",
    "HierarchicalTransport",
    "NetworkTransport",
    "ODCTimeoutError",
    "ShmTransport",
    "TRANSPORTS",
    "TRANSPORT_CLASSES",
    "Transport",
    "TransportChoice",
    "choose_transport",
    "create_transport",
    "host_id",
]


def create_transport(
    name: str | Transport,
    *,
    rank: int,
    world_size: int,
    timeout: float,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    atomics: bool = True,
) -> Transport:
    """Build the transport called ``name`` (an instance passes through); ``"auto"`` chooses, collectively, by
    `choose_transport` (which says why, and where nothing fits raises on every rank what to change)."""
    if isinstance(name, Transport):
        return name
    choice = choose_transport(name, device=device, world_size=world_size, group=group, atomics=atomics)
    return TRANSPORT_CLASSES[choice.name].create(rank, world_size, timeout=timeout, group=group, device=device)
