"""The ``"network"`` transport: one-sided reads and accumulates over TCP, served by a background thread on each owner."""

from .transport import DEFAULT_CHUNK_BYTES, NetworkTransport, default_address

__all__ = ["DEFAULT_CHUNK_BYTES", "NetworkTransport", "default_address"]
