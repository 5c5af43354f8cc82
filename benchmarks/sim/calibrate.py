"""Micro-measurements that calibrate the simulator on this machine (2 CPU processes, one thread each).

Kept apart from the figures the simulator is validated against (the engine benchmark's FSDP2 and ODC arms):

- `measure_gloo`: time of gloo ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` alone, at given sizes, fitted
  to ``latency + bytes / bandwidth`` (what FSDP2 pays per param group and pass on CPU);
- `measure_compute`: effective FLOP/s of one process training the engine benchmark's toy model unsharded (forward,
  backward, AdamW) on one thread — the benchmark's "limit" arm measured on its own;
- `measure_microbatch_comm`: what one microbatch's communication costs FSDP2 and ODC with a real transformers model
  (the end-to-end benchmark's): forward + backward of a few tokens, sharded per layer as accelerate does, minus the
  same microbatch on an unsharded copy; no training data involved.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from benchmarks.sim.simulator import Hardware


def cpu_hardware(flops: float, gloo: dict[str, Any], shm: dict[str, float], world: int) -> Hardware:
    """`Hardware` for W CPU processes on one host from measured figures: ``flops``, `measure_gloo`'s fits and the
    shared-memory figures (`results.load_shm_figures`: ``read_MBps``, ``acc_MBps``, ``read_us``, ``acc_us``,
    ``barrier_us``); no overlap.

    FSDP2 pays one all-gather per group in forward and one all-gather + one reduce-scatter in backward. The simulator
    has one collective bandwidth, so it gets the per-byte mean of the two (backward moves one of each).
    """
    ag_lat, ag_bw = gloo["ag_fit"]
    rs_lat, rs_bw = gloo["rs_fit"]
    bw, lat = 2.0 / (1.0 / ag_bw + 1.0 / rs_bw), (ag_lat + rs_lat) / 2
    return Hardware(
        flops=flops, gpus_per_node=world, intra_bw=bw, inter_bw=bw, intra_lat=lat, inter_lat=lat,
        p2p_intra_bw=2.0 / (1e-6 / shm["read_MBps"] + 1e-6 / shm["acc_MBps"]),
        p2p_lat=(shm["read_us"] + shm["acc_us"]) / 2 * 1e-6, barrier_lat=shm["barrier_us"] * 1e-6, overlap=False,
    )  # fmt: skip


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
    from odc_accelerate.testing import launch

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

    from odc_accelerate.testing.models import ToyConfig, build_model, token_loss_sum

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


def _comm_worker(rank: int, world_size: int, config: dict[str, Any], tokens: int, repeats: int) -> dict[str, float]:
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from odc_accelerate import ODCEngine
    from odc_accelerate.telemetry import CollectiveTimer

    cfg = AutoConfig.for_model(**config)

    def build():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)

    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(rank))

    def microbatch_times(model) -> list[float]:
        times = []
        for i in range(repeats + 2):
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            if i >= 2:  # warm-up: lazy init, first allocations
                times.append(time.perf_counter() - t0)
        return times

    out: dict[str, float] = {}
    out["none"] = statistics.median(microbatch_times(build()))
    for system in ("fsdp2", "odc"):
        model = build()
        for layer in model.model.layers:  # accelerate's TRANSFORMER_BASED_WRAP: one group per decoder layer + root
            fully_shard(layer, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        if system == "odc":
            with ODCEngine(model):
                out[system] = statistics.median(microbatch_times(model))
        else:
            timer = CollectiveTimer(model)  # synchronous collectives, as the end-to-end benchmark times them
            try:
                out[system] = statistics.median(microbatch_times(model))
            finally:
                timer.close()
        torch.distributed.barrier()
    return out


def measure_microbatch_comm(config: dict[str, Any], tokens: int = 8, repeats: int = 8) -> dict[str, float]:
    """Seconds one microbatch (forward + backward of ``tokens`` tokens) spends beyond its compute, per system.

    Two gloo processes, one thread each, build the model from ``config`` (a transformers config dict with
    ``model_type``), shard it per decoder layer plus the root (accelerate's FSDP2 wrapping) and time microbatches
    under FSDP2 (collectives made synchronous, as the end-to-end benchmark times them) and under ODC, and on an
    unsharded copy. Returns ``{"fsdp2": s, "odc": s, "none": s, "fsdp2_comm": s, "odc_comm": s}`` (medians, the slower
    rank; ``*_comm`` = system - none).
    """
    from odc_accelerate.testing import launch

    res = launch(_comm_worker, 2, config, tokens, repeats, timeout=600, threads=1)
    out = {k: max(r[k] for r in res) for k in ("none", "fsdp2", "odc")}
    out["fsdp2_comm"] = max(0.0, out["fsdp2"] - out["none"])
    out["odc_comm"] = max(0.0, out["odc"] - out["none"])
    return out
