"""Transports: how ranks read each other's shards and add into each other's gradient accumulators."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .base import BufferSpec, ODCTimeoutError, Transport
from .shm import ShmTransport

logger = logging.getLogger(__name__)

__all__ = ["BufferSpec", "ODCTimeoutError", "ShmTransport", "Transport", "create_transport", "TRANSPORTS"]

#: transport names accepted by ``ODCEngine(transport=...)``
TRANSPORTS = ("auto", "shm")


def create_transport(
    name: str | Transport,
    *,
    rank: int,
    world_size: int,
    timeout: float,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> Transport:
    """Build the transport called ``name`` (or pass an instance through).

    ``"auto"`` picks shared memory for CPU tensors; GPU and cross-host transports come later and
    are refused with a clear error until then.
    """
    if isinstance(name, Transport):
        return name
    if name not in TRANSPORTS:
        raise ValueError(f"unknown ODC transport {name!r}; choose one of {list(TRANSPORTS)} or pass a Transport")
    if device.type != "cpu":
        raise NotImplementedError(
            f"ODC has no transport for {device.type} tensors yet (only 'shm' for CPU); "
            "train on CPU or use plain FSDP2 on this device"
        )
    chosen = ShmTransport(rank, world_size, timeout=timeout, group=group)
    if name == "auto":
        logger.info("ODC transport 'auto' chose %r for %s tensors", chosen.name, device.type)
    return chosen
