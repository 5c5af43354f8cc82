"""Transports: how ranks read each other's shards and add into each other's gradient accumulators.

=================  ==================================================================================
``"shm"``          CPU tensors, every rank on one host: ``/dev/shm`` mappings and record locks.
``"network"``      CPU tensors, any hosts: TCP with an owner-side service thread per rank.
``"hierarchical"`` CPU tensors, several hosts: ``"shm"`` within a host, ``"network"`` across hosts.
``"cuda"``         CUDA tensors, one node: torch symmetric memory (CUDA IPC), atomic adds into fp32 accumulators.
``"auto"``         picks one of the above (see :func:`create_transport`) and logs the choice.
=================  ==================================================================================
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .base import HOST_ID_ENV, BufferSpec, ODCTimeoutError, Transport, host_id
from .cuda import CudaTransport, device_refusal, gather_device_facts
from .hierarchical import HierarchicalTransport, gather_hosts, host_layout
from .network import NetworkTransport
from .shm import ShmTransport

logger = logging.getLogger(__name__)

__all__ = [
    "BufferSpec",
    "CudaTransport",
    "HOST_ID_ENV",
    "HierarchicalTransport",
    "NetworkTransport",
    "ODCTimeoutError",
    "ShmTransport",
    "Transport",
    "TRANSPORTS",
    "create_transport",
    "host_id",
]

#: transport names accepted by ``ODCEngine(transport=...)``
TRANSPORTS = ("auto", "shm", "network", "hierarchical", "cuda")
_CPU_ONLY = ("shm", "network", "hierarchical")


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
    """Build the transport called ``name`` (or pass an instance through).

    ``"auto"`` is collective (one ``all_gather_object`` of host identities over ``group``) and picks:

    * CPU tensors, every rank on one host: ``"shm"``;
    * CPU tensors, one rank per host: ``"network"``; several ranks on some host: ``"hierarchical"``;
    * CUDA tensors, every rank on one host and the ``"cuda"`` transport usable on every rank (its device checks:
      GPUs not shared unless allowed, peers visible and peer-accessible with native atomics, CUDA symmetric-memory
      backend): ``"cuda"``.

    Host identity is :func:`~odc_accelerate.transport.host_id` (``$ODC_HOST_ID`` overrides it). The choice is logged
    at INFO. ``atomics=False`` (the ``ordered`` reduction, or one the transport may still choose, and a frozen engine)
    accepts GPUs that can read but not add into each other's memory natively. CUDA tensors have no other transport: across hosts, or where a device check fails, ``"auto"`` logs the
    reason at ERROR and raises, on every rank, an error saying what to change (or to use plain FSDP2).
    """
    if isinstance(name, Transport):
        return name
    if name not in TRANSPORTS:
        raise ValueError(f"unknown ODC transport {name!r}; choose one of {list(TRANSPORTS)} or pass a Transport")
    if name in _CPU_ONLY and device.type != "cpu":
        raise ValueError(
            f"ODC transport {name!r} moves CPU tensors, but the model is on {device.type}; "
            f"use transport='cuda' (one node) or 'auto'"
        )
    if name == "cuda" and device.type != "cuda":
        raise ValueError(f"ODC transport 'cuda' needs a model on CUDA, got {device.type}; use 'auto' for CPU models")
    if device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"ODC has no transport for {device.type} tensors; use plain FSDP2 on this device")
    reason = ""
    if name == "auto":
        hosts = host_layout(gather_hosts(group, world_size))
        if device.type == "cuda":
            if len(hosts) > 1:
                raise NotImplementedError(
                    f"ODC has no cross-host transport for CUDA tensors yet (ranks span {len(hosts)} hosts); "
                    "use plain FSDP2 across nodes or keep the ODC group within one node"
                )
            # Collective, and decided from every rank's facts: all ranks pick or refuse together.
            missing = device_refusal(gather_device_facts(group, world_size, device), atomics=atomics)
            if missing:
                message = (
                    f"ODC transport 'auto' found no usable transport for CUDA tensors: {missing}. "
                    "ODC has no other GPU transport; fix the above or train with plain FSDP2 (ODC off)"
                )
                logger.error(message)
                raise RuntimeError(message)
            name, reason = (
                "cuda",
                "CUDA tensors on one host, peers mapped" + (" with native atomics" if atomics else ""),
            )
        elif len(hosts) == 1:
            name, reason = "shm", "CPU tensors, every rank on one host"
        elif all(len(ranks) == 1 for ranks in hosts):
            name, reason = "network", f"CPU tensors, {len(hosts)} hosts with one rank each"
        else:
            name, reason = "hierarchical", f"CPU tensors, ranks per host {[len(r) for r in hosts]}"
    kwargs = dict(timeout=timeout, group=group)
    if name == "shm":
        chosen: Transport = ShmTransport(rank, world_size, **kwargs)
    elif name == "network":
        chosen = NetworkTransport(rank, world_size, **kwargs)
    elif name == "hierarchical":
        chosen = HierarchicalTransport(rank, world_size, **kwargs)
    else:
        chosen = CudaTransport(rank, world_size, device=device, **kwargs)
    # Kept on the transport for the run's banner (`ODCTrainerMixin`): which transport runs, and why.
    chosen.chosen_because = f"auto: {reason}" if reason else "set by odc_transport"
    if reason:
        logger.info("ODC transport 'auto' chose %r (%s)", chosen.name, reason)
    return chosen
