"""Wire format of the network transport: one fixed header per message, and the socket helpers both sides use.

Every message starts with `HEADER` (operation, buffer index, two 64-bit fields ``a`` and ``b``); the table of
operations is in docs/transports.md, "Protocol details".
"""

from __future__ import annotations

import os
import socket
import struct

import torch

#: message header: operation, buffer index, ``a``, ``b`` (the table above)
HEADER = struct.Struct("<BxHxxxxQQ")
HELLO, READ, ACCUMULATE, ARRIVE, BYE, ABORT, CLAIM = 1, 2, 3, 4, 5, 6, 7
#: a claim's answer: the counter's value before the add
CLAIM_REPLY = struct.Struct("<Q")
#: a service's answer to an accepted `HELLO`
HELLO_OK = b"\x01"
#: bytes of the job id a `HELLO` carries (padded with spaces)
JOB_BYTES = 16
# Payloads up to this size are sent with their header in one syscall (one TCP segment) at the cost of a copy.
COALESCE_BYTES = 64 << 10


def default_address() -> str:
    """The local IPv4 address other ranks can reach this one at.

    The address of the interface that routes to ``MASTER_ADDR`` (no packet is sent: a UDP ``connect`` only picks a
    route), else the address the host name resolves to, else loopback.
    """
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, 9))
                return probe.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def byte_view(tensor: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU tensor, sharing its memory (works for bfloat16, which numpy lacks)."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; raise ConnectionError if the peer closes first."""
    got, total = 0, len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            raise ConnectionError("connection closed by peer")
        got += n


def send_msg(sock: socket.socket, header: bytes, payload: memoryview | None = None) -> None:
    """Send ``header`` and then ``payload`` (if any), in one syscall where the payload is small."""
    if payload is None:
        sock.sendall(header)
    elif len(payload) <= COALESCE_BYTES:
        sock.sendall(header + payload.tobytes())
    else:
        sock.sendall(header)
        sock.sendall(payload)
