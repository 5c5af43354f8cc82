"""Which transport runs, and why: `choose_transport`, the rule of ``transport="auto"``, as a frozen `TransportChoice`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .base import Transport
from .hierarchical import gather_hosts, host_layout
from .registry import TRANSPORT_CLASSES, TRANSPORTS, serving

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class TransportChoice:
    """The transport that runs, and why (``"auto: ..."``, ``"set by odc_transport"`` or ``"given as a Transport"``)."""

    name: str
    reason: str


def choose_transport(
    requested: str | Transport,
    *,
    device: torch.device,
    world_size: int,
    group: dist.ProcessGroup | None = None,
    atomics: bool = True,
) -> TransportChoice:
    """The transport to run for a model on ``device``: ``requested``, once checked, or ``"auto"``'s choice.

    ``"auto"`` is collective (one ``all_gather_object`` of host identities, `~odc_accelerate.transport.host_id`, over
    ``group``): it takes the first transport of `TRANSPORT_CLASSES` that moves ``device``'s tensors, fits the ranks'
    hosts (`Transport.fits_hosts`) and passes its own checks (`Transport.auto_refusal`, collective where it asks its
    peers): ``shm`` on one host, ``network`` with one rank per host, ``hierarchical`` otherwise; ``cuda`` for CUDA
    tensors on one host. It logs the choice at INFO; where nothing fits it raises, on every rank, what to change.
    ``atomics=False`` (no explicit ``atomic`` reduction, or a frozen engine) accepts GPUs that can read but not add
    into each other's memory natively.
    """
    if isinstance(requested, Transport):
        return TransportChoice(name=requested.name, reason="given as a Transport")
    if requested not in TRANSPORTS:
        raise ValueError(f"unknown ODC transport {requested!r}; choose one of {list(TRANSPORTS)} or pass a Transport")
    candidates = serving(device.type)
    if requested != "auto":
        cls = TRANSPORT_CLASSES[requested]
        if device.type not in cls.devices:
            fix = " or ".join([repr(c.name) for c in candidates] + ["'auto'"]) if candidates else None
            raise ValueError(
                f"ODC transport {requested!r} moves {_kinds(cls.devices)} tensors, but the model is on {device.type}; "
                + (f"use transport={fix}" if fix else "use plain FSDP2 on this device")
            )
        return TransportChoice(name=requested, reason="set by odc_transport")
    if not candidates:
        raise NotImplementedError(f"ODC has no transport for {device.type} tensors; use plain FSDP2 on this device")
    per_host = [len(ranks) for ranks in host_layout(gather_hosts(group, world_size))]
    fitting = [cls for cls in candidates if cls.fits_hosts(per_host)]
    if not fitting:
        raise NotImplementedError(
            f"ODC has no cross-host transport for {_kinds((device.type,))} tensors yet (ranks span {len(per_host)} "
            "hosts); use plain FSDP2 across nodes or keep the ODC group within one node"
        )
    refusals = []
    for cls in fitting:
        refusal = cls.auto_refusal(group=group, world_size=world_size, device=device, atomics=atomics)
        if refusal is None:
            reason = f"{_kinds((device.type,))} tensors, {_layout(per_host)}"
            logger.info("ODC transport 'auto' chose %r (%s)", cls.name, reason)
            return TransportChoice(name=cls.name, reason=f"auto: {reason}")
        refusals.append(refusal)
    message = (
        f"ODC transport 'auto' found no usable transport for {_kinds((device.type,))} tensors: {'; '.join(refusals)}. "
        "ODC has no other transport for them; fix the above or train with plain FSDP2 (ODC off)"
    )
    logger.error(message)
    raise RuntimeError(message)


def _kinds(devices: Sequence[str]) -> str:
    return "/".join(d.upper() for d in devices)


def _layout(per_host: Sequence[int]) -> str:
    if len(per_host) == 1:
        return "every rank on one host"
    if max(per_host) == 1:
        return f"{len(per_host)} hosts with one rank each"
    return f"ranks per host {list(per_host)}"
