"""``python -m odc_accelerate.bench transport``: read / accumulate bandwidth and latency per transport.

Two CPU processes on this machine (gloo on loopback). Rank 0 measures one-sided operations against rank 1, whose
training thread sits in a barrier the whole time (as an owner would be busy computing): ``shm`` (shared memory),
``network`` (TCP over loopback, owner-side service thread) and ``hierarchical`` with the two ranks claiming distinct
hosts (``ODC_HOST_ID``), i.e. its cross-host path. Every repeat measures every transport in turn (interleaved), the
table shows medians over repeats.

* read MB/s: ``read`` of a whole peer buffer (1 MiB and 16 MiB);
* accumulate MB/s: ``accumulate`` into the peer's buffer, timed up to the barrier that makes the adds visible (the
  network transport sends adds without waiting for them; the barrier waits until they are applied);
* latency us: one ``read`` / ``accumulate`` of a 64-byte buffer (median per call) and one two-rank ``barrier``.

The last line of output is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

SIZES_MIB = (1, 16)
TRANSPORTS = ("shm", "network", "hierarchical")


def _rank_main(rank: int, world_size: int, repeats: int, iters: int) -> dict[str, Any] | None:
    from ..transport import BufferSpec, create_transport

    specs = {f"b{mib}": BufferSpec(mib * 2**20 // 4, torch.float32) for mib in SIZES_MIB}
    specs["tiny"] = BufferSpec(16, torch.float32)
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


COLUMNS = [
    ("read_1MiB_MBps", "read 1MiB MB/s", "{:.0f}"),
    ("read_16MiB_MBps", "read 16MiB MB/s", "{:.0f}"),
    ("acc_1MiB_MBps", "acc 1MiB MB/s", "{:.0f}"),
    ("acc_16MiB_MBps", "acc 16MiB MB/s", "{:.0f}"),
    ("read_latency_us", "read 64B us", "{:.1f}"),
    ("acc_latency_us", "acc 64B us", "{:.1f}"),
    ("barrier_latency_us", "barrier us", "{:.1f}"),
]


def format_table(results: dict[str, dict[str, float]]) -> str:
    header = ["transport"] + [title for _, title, _ in COLUMNS]
    rows = [[name] + [fmt.format(res[key]) for key, _, fmt in COLUMNS] for name, res in results.items()]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ..testing import launch

    parser = argparse.ArgumentParser(prog="python -m odc_accelerate.bench transport", description=__doc__)
    parser.add_argument("--repeats", type=int, default=9, help="interleaved repeats (median reported)")
    parser.add_argument("--iters", type=int, default=32, help="1 MiB operations per bandwidth sample")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = launch(_rank_main, 2, args.repeats, args.iters, timeout=600)[0]
    print(f"ODC transports, 2 CPU processes on one machine, medians of {args.repeats} interleaved repeats")
    print("(hierarchical: the two ranks claim distinct hosts, so this is its cross-host TCP path)")
    print(format_table(results))
    print(f"wall time {time.perf_counter() - start:.1f}s")
    print(json.dumps({"benchmark": "transport", "repeats": args.repeats, "results": results}))
    return 0
