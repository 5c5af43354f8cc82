"""What runs inside the transport benchmark's 2 ranks: rank 0 measures, rank 1 only joins the barriers."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

SIZES_MIB = (1, 16)
TRANSPORTS = ("shm", "network", "hierarchical")


def rank_main(rank: int, world_size: int, repeats: int, iters: int) -> dict[str, Any] | None:
    from odc_accelerate.transport import BufferSpec, create_transport

    specs = {f"b{mib}": BufferSpec(numel=mib * 2**20 // 4, dtype=torch.float32) for mib in SIZES_MIB}
    specs["tiny"] = BufferSpec(numel=16, dtype=torch.float32)
    transports = {}
    for name in TRANSPORTS:
        if name == "hierarchical":
            os.environ["ODC_HOST_ID"] = f"bench-host{rank}"
        t = create_transport(name, rank=rank, world_size=world_size, timeout=120.0, device=torch.device("cpu"))
        t.register(specs)
        transports[name] = t
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in TRANSPORTS}
    for _ in range(repeats):
        for name, t in transports.items():
            t.barrier()
            if rank == 0:
                for key, value in _measure(t, iters).items():
                    samples[name].setdefault(key, []).append(value)
            else:
                _idle(t)
    for t in transports.values():
        t.close()
    if rank != 0:
        return None
    return {name: {key: statistics.median(vals) for key, vals in res.items()} for name, res in samples.items()}


def _measure(t, iters: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for mib in SIZES_MIB:
        name, nbytes = f"b{mib}", mib * 2**20
        buf = torch.ones(nbytes // 4)
        n = max(2, iters // mib)
        t.read(1, name, buf)  # warm
        start = time.perf_counter()
        for _ in range(n):
            t.read(1, name, buf)
        out[f"read_{mib}MiB_MBps"] = n * nbytes / (time.perf_counter() - start) / 1e6
        start = time.perf_counter()
        for _ in range(n):
            t.accumulate(1, name, buf)
        t.barrier()  # rank 1 is already waiting in its barrier: this includes the time to apply the adds
        out[f"acc_{mib}MiB_MBps"] = n * nbytes / (time.perf_counter() - start) / 1e6
        t.barrier()
    tiny = torch.ones(16)
    for op in ("read", "acc"):
        times = []
        for _ in range(200):
            start = time.perf_counter()
            if op == "read":
                t.read(1, "tiny", tiny)
            else:
                t.accumulate(1, "tiny", tiny)
            times.append(time.perf_counter() - start)
        out[f"{op}_latency_us"] = statistics.median(times) * 1e6
    times = []
    for _ in range(50):
        start = time.perf_counter()
        t.barrier()
        times.append(time.perf_counter() - start)
    out["barrier_latency_us"] = statistics.median(times) * 1e6
    return out


def _idle(t) -> None:
    """Rank 1: no part in any read or add, only the barriers rank 0's measurement makes (2 per size, then 50)."""
    for _ in range(2 * len(SIZES_MIB) + 50):
        t.barrier()
