"""Per-rank functions for transport-level tests (run through :func:`odc_accelerate.testing.launch`)."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import torch

from odc_accelerate.transport import BufferSpec, NetworkTransport, ODCTimeoutError, create_transport


def _make(name: str, rank: int, world_size: int, timeout: float, host_ids: list[str] | None, **kwargs: Any):
    if host_ids is not None:
        os.environ["ODC_HOST_ID"] = host_ids[rank]
    if name == "network" and kwargs:
        return NetworkTransport(rank, world_size, timeout=timeout, **kwargs)
    return create_transport(name, rank=rank, world_size=world_size, timeout=timeout, device=torch.device("cpu"))


def pattern(rank: int, step: int, numel: int) -> torch.Tensor:
    """Integer-valued floats, different per (rank, step): every sum of them is exact in fp32."""
    return ((torch.arange(numel, dtype=torch.float32) + 3 * rank + step) % 11) - 5


def concurrent_adds(
    rank: int, world_size: int, name: str, host_ids: list[str] | None, numel: int, rounds: int, chunk_bytes: int
) -> dict[str, Any]:
    """Every rank (the owner too) adds ``rounds`` patterns into rank 0's buffer at once; rank 0 returns the sum."""
    kwargs = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
    transport = _make(name, rank, world_size, 60.0, host_ids, **kwargs)
    buffers = transport.register(
        {"acc": BufferSpec(numel=numel, dtype=torch.float32), "half": BufferSpec(numel=33, dtype=torch.bfloat16)}
    )
    transport.barrier()
    for step in range(rounds):
        transport.accumulate(0, "acc", pattern(rank, step, numel))
        transport.accumulate(0, "half", torch.ones(33, dtype=torch.bfloat16))
    transport.barrier()
    expected = sum(pattern(r, step, numel) for r in range(world_size) for step in range(rounds))
    out: dict[str, Any] = {"transport": transport.name}
    if rank == 0:
        out["own_error"] = float((buffers["acc"] - expected).abs().max())
        out["half"] = buffers["half"].float().unique().tolist()
    # every rank reads rank 0's result one-sidedly as well
    seen = torch.empty(numel)
    transport.read(0, "acc", seen)
    out["read_error"] = float((seen - expected).abs().max())
    endpoint = getattr(transport, "endpoints", None) or getattr(getattr(transport, "_net", None), "endpoints", [])
    transport.barrier()
    transport.close()
    out["threads_after_close"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("odc-"))
    if endpoint:
        host, port = endpoint[rank]
        try:
            socket.create_connection((host, port), timeout=2).close()
            out["port_open_after_close"] = True
        except OSError:
            out["port_open_after_close"] = False
    return out


def barrier_cases(rank: int, world_size: int, cases: list[str]) -> dict[str, Any]:
    """Run :func:`barrier_behaviour` for each case in turn (one process start for all)."""
    return {case: barrier_behaviour(rank, world_size, case) for case in cases}


def barrier_behaviour(rank: int, world_size: int, case: str) -> dict[str, Any]:
    """``late``: rank 1 arrives after rank 0's timeout (both fail, each naming the other's part). ``closed``: rank 1 closes instead of arriving.
    ``stray``: a connection with the wrong job id is refused and the transport keeps working."""
    transport = NetworkTransport(rank, world_size, timeout=1.5)
    buffers = transport.register({"x": BufferSpec(numel=8, dtype=torch.float32)})
    buffers["x"].fill_(rank + 1)
    transport.barrier()
    out: dict[str, Any] = {}
    if case == "late":
        if rank == 1:
            time.sleep(4.0)
        try:
            transport.barrier()
            out["raised"] = None
        except ODCTimeoutError as err:
            out["raised"], out["ranks"] = str(err), err.ranks
    elif case == "closed":
        if rank == 1:
            transport.close()
            return out
        try:
            transport.barrier()
            out["raised"] = None
        except ODCTimeoutError as err:
            out["raised"], out["ranks"] = str(err), err.ranks
    elif case == "stray":
        peer = 1 - rank
        host, port = transport.endpoints[peer]
        with socket.create_connection((host, port), timeout=5) as stray:
            stray.sendall(b"\x01" + b"\x00" * 23 + b"not-this-job".ljust(16))
            out["stray_reply"] = stray.recv(1)  # b"" = closed without the hello acknowledgement
        seen = torch.empty(8)
        transport.read(peer, "x", seen)
        out["read"] = seen.tolist()
        transport.barrier()
    transport.close()
    return out
