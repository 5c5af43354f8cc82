"""Micro-measurements that calibrate the simulator on this machine (2 CPU processes, one thread each).

Kept apart from the figures the simulator is validated against (the engine benchmark's FSDP2 and ODC arms):

- `measure_gloo`: time of gloo ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` alone, at given sizes, fitted
  to ``latency + bytes / bandwidth`` (what FSDP2 pays per param group and pass on CPU);
- `measure_compute`: effective FLOP/s of one process training the engine benchmark's toy model unsharded (forward,
  backward, AdamW) on one thread — the benchmark's "limit" arm measured on its own.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np


def _gloo_worker(rank: int, world_size: int, sizes: list[int], repeats: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    out: dict[str, list[float]] = {"ag": [], "rs": []}
    for nbytes in sizes:
        numel = nbytes // 4 // world_size * world_size
        full = torch.ones(numel)
        shard = torch.ones(numel // world_size)
        times = {"ag": [], "rs": []}
        for i in range(repeats + 2):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_gather_into_tensor(full, shard)
            t1 = time.perf_counter()
            dist.reduce_scatter_tensor(shard, full)
            t2 = time.perf_counter()
            if i >= 2:  # warm-up
                times["ag"].append(t1 - t0)
                times["rs"].append(t2 - t1)
        for key in out:
            out[key].append(statistics.median(times[key]))
    return out


def measure_gloo(sizes: list[int], repeats: int = 20) -> dict[str, Any]:
    """Median gloo collective times at ``sizes`` (bytes of the full tensor) and a least-squares line per collective.

    Returns ``{"sizes": [...], "ag_s": [...], "rs_s": [...], "ag_fit": (lat_s, bw), "rs_fit": (lat_s, bw)}`` where
    ``bw`` is in bytes/s of the *full* size times ``(W-1)/W`` (the ring's per-rank volume), as `Hardware` expects.
    """
    from ..testing import launch

    res = launch(_gloo_worker, 2, sizes, repeats, timeout=600, threads=1)
    ag = [max(a, b) for a, b in zip(res[0]["ag"], res[1]["ag"], strict=True)]
    rs = [max(a, b) for a, b in zip(res[0]["rs"], res[1]["rs"], strict=True)]
    vol = np.asarray(sizes, dtype=np.float64) / 2  # (W-1)/W with W = 2
    out: dict[str, Any] = {"sizes": list(sizes), "ag_s": ag, "rs_s": rs}
    for key, ys in (("ag_fit", ag), ("rs_fit", rs)):
        slope, intercept = np.polyfit(vol, np.asarray(ys), 1)
        out[key] = (max(float(intercept), 0.0), 1.0 / float(slope))
    return out


def measure_compute(cfg: dict[str, Any], lengths: list[int], repeats: int = 5) -> float:
    """Median seconds of one unsharded training step (forward + backward of every length, AdamW) on one thread."""
    import torch

    from ..testing.models import ToyConfig, build_model, token_loss_sum

    torch.set_num_threads(1)
    model = build_model(ToyConfig(**cfg), seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    times = []
    for i in range(repeats + 1):
        batches = [torch.randint(0, cfg["vocab"], (1, n + 1), generator=gen) for n in lengths]
        t0 = time.perf_counter()
        for ids in batches:
            loss, _ = token_loss_sum(model, ids)
            loss.backward()
        optim.step()
        optim.zero_grad()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
