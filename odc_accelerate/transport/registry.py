"""The transports by name, in the order ``"auto"`` prefers them; every list of their facts is read from here."""

from __future__ import annotations

from types import MappingProxyType

from .base import Transport
from .cuda import CudaTransport
from .hierarchical import HierarchicalTransport
from .network import NetworkTransport
from .shm import ShmTransport

#: name -> class; ``"auto"`` (`.auto.choose_transport`) takes the first that serves the device and the hosts
TRANSPORT_CLASSES: MappingProxyType[str, type[Transport]] = MappingProxyType(
    {cls.name: cls for cls in (ShmTransport, NetworkTransport, HierarchicalTransport, CudaTransport)}
)

#: transport names accepted by ``ODCEngine(transport=...)`` and ``odc_transport``
TRANSPORTS: tuple[str, ...] = ("auto", *TRANSPORT_CLASSES)


def serving(device_type: str) -> list[type[Transport]]:
    """The transports that move tensors of ``device_type``, in ``"auto"``'s order."""
    return [cls for cls in TRANSPORT_CLASSES.values() if device_type in cls.devices]


def spans_hosts(transport: str | Transport) -> bool:
    """Whether the transport named (or given) ``transport`` reaches other hosts; False for ``"auto"``, which chooses
    within the hosts it finds."""
    cls = type(transport) if isinstance(transport, Transport) else TRANSPORT_CLASSES.get(transport)
    return cls is not None and cls.spans_hosts
