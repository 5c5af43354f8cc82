"""The GPU check's cases that only a GPU shows: ``refusals``, ``memory``, ``memory_policy`` and ``speed``.

* ``refusals``: a shared GPU without the override, a non-CUDA symmetric-memory backend and too little free memory are
  refused on every rank with a message naming the fix (``"cuda"`` and ``"auto"``), before any allocation;
* ``memory``: two engines made and closed in turn in one process, the baseline taken after FSDP2's lazy init: per
  rank, what the GPU loses to the second engine equals the transport's report (within 8 MiB) and ``close()`` gives it
  all back (within 4 MiB); what the first engine takes beyond its report and never gives back (CUDA context growth,
  torch's ``CUDAPeerAllocInfo``) is reported as ``uncounted_first_engine_per_rank``;
* ``memory_policy``: the engine's peak memory per rank (torch's allocator) under the policy ``neither`` against what a
  rank may hold (4 fp32 shards + FSDP2's working set + one microbatch's activations + the staging pool), and ``both``
  beside it; the same worker and bound as `tests/multiprocess/test_engine_memory_policy.py`;
* ``speed``: read and atomic-accumulate bandwidth between the two ranks, and every accumulate path side by side at
  1 GiB of source, each rank timed alone (`accumulate_bench`). Both ranks share one GPU: single-GPU copy and atomic
  throughput, not NVLink.
"""

from __future__ import annotations

import gc
import traceback
from typing import Any

import torch
import torch.distributed as dist

from odc_accelerate.testing import launch
from odc_accelerate.testing.models import ToyConfig, build_model, shard_model
from odc_accelerate.transport import BufferSpec, CudaTransport

from .check_common import MEDIUM, OVERLAP_ENV, SMALL, make_transport, precision_policy, rank_device


def refusal_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, str]:
    """Build an engine that must be refused; return each attempt's error text ('' if it was not refused) and its
    traceback."""
    from odc_accelerate._compat.torch import fsdp as fsdp_compat
    from odc_accelerate.engine import ODCEngine

    device = rank_device("cuda")
    cfg = ToyConfig(**spec["cfg"])
    model = shard_model(build_model(cfg, seed=0).to(device), mp_policy=precision_policy("fp32"))
    filler = None
    if spec.get("leave_free_mib") is not None:
        # FSDP2's lazy init first (its streams need a little GPU memory), so that the transport's check is what meets
        # the full GPU; the engine turns an out-of-memory error in FSDP2's own lazy init into a refusal as well.
        fsdp_compat.lazy_init(model)
        dist.barrier()
        if rank == 0:  # leave less free memory than the two transports need (the ranks share this GPU)
            free, _ = torch.cuda.mem_get_info(device)
            filler = torch.empty(max(free - spec["leave_free_mib"] * 2**20, 0), dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
        dist.barrier()
    out = {}
    for name in spec["transports"]:
        try:
            engine = ODCEngine(model, transport=make_transport({**spec, "transport": name}, rank, world_size, device))
        except Exception as err:  # the refusal under test
            out[name] = f"{type(err).__name__}: {err}"
            out[f"traceback/{name}"] = "".join(traceback.format_exception(err))
        else:
            engine.close()
            out[name] = ""
    del filler
    dist.barrier()
    return out


def memory_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Free GPU memory before, with and after each of two engines made and closed in turn; the transport's report.

    The baseline is taken after FSDP2's lazy initialisation (its streams and buffers are FSDP2's, not ODC's). The
    first engine of a process also grows what nothing gives back before the process ends: the CUDA context (kernels
    loaded on first use) and torch's peer tables of symmetric memory (``CUDAPeerAllocInfo``, which has no
    destructor). The second engine shows what ODC itself takes and returns.
    """
    from odc_accelerate._compat.torch import fsdp as fsdp_compat
    from odc_accelerate.engine import ODCEngine

    device = rank_device("cuda")
    cfg = ToyConfig(**spec["cfg"])
    model = shard_model(build_model(cfg, seed=0).to(device), mp_policy=precision_policy("bf16"))
    fsdp_compat.lazy_init(model)

    def measure() -> dict[str, int]:
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        dist.barrier()  # both ranks (one GPU) at the same point
        free, _ = torch.cuda.mem_get_info(device)
        dist.barrier()
        return {"free": int(free), "allocated": int(torch.cuda.memory_allocated(device))}

    cycles = []
    for _ in range(spec.get("cycles", 2)):
        before = measure()
        engine = ODCEngine(model)
        with_engine = measure()
        report = engine.transport.memory_report()
        engine.close()
        del engine
        after = measure()
        cycles.append({"before": before, "with_engine": with_engine, "after_close": after, "report": report})
    return {"cycles": cycles}


def speed_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Bandwidth of ``read`` and ``accumulate`` (bf16 into fp32, atomic) between the two ranks, and a sum check."""
    device = rank_device("cuda")
    numel, iters = spec["numel"], spec["iters"]
    transport = CudaTransport(rank, world_size, timeout=120.0, device=device)
    specs = {
        "p": BufferSpec(numel=numel, dtype=torch.bfloat16),
        "g": BufferSpec(numel=numel, dtype=torch.bfloat16, accumulated=True),
    }
    own = transport.register(specs)
    own["p"].fill_(float(rank + 1))
    gen = torch.Generator(device=device).manual_seed(rank)
    src = torch.randn(numel, generator=gen, device=device).to(torch.bfloat16)
    out = torch.empty(numel, dtype=torch.bfloat16, device=device)
    peer = (rank + 1) % world_size
    transport.barrier()
    results: dict[str, Any] = {"memory_report": transport.memory_report(), "chunk_numel": transport.plan.chunk_numel}
    ops = (
        ("read", lambda: transport.read(peer, "p", out)),
        ("accumulate", lambda: transport.accumulate(peer, "g", src)),
    )
    for what, op in ops:
        op()  # warm-up (the accumulate's warm-up counts in the sum check below)
        transport.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            op()
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        results[f"{what}_GBps"] = iters * numel * 2 / seconds / 1e9  # bf16 bytes moved per call
        results[f"{what}_ms"] = seconds / iters * 1e3
        transport.barrier()
    results["read_ok"] = bool(torch.equal(out, torch.full_like(out, float(peer + 1))))
    # Every peer added its src (iters + 1) times into this rank's fp32 accumulator.
    expected = torch.zeros(numel, dtype=torch.float64, device=device)
    for sender in range(world_size):
        if sender != rank:
            g = torch.Generator(device=device).manual_seed(sender)
            expected += torch.randn(numel, generator=g, device=device).to(torch.bfloat16).double() * (iters + 1)
    err = (own["g"].double() - expected).abs().max().item()
    results["accumulate_max_abs_err"] = err
    results["accumulate_ok"] = err <= 1e-4 * (iters + 1)
    transport.close()
    return results


def case_refusals() -> dict[str, Any]:
    base = dict(cfg=SMALL, transports=["cuda", "auto"])
    shared = launch(refusal_worker, 2, base, timeout=300, env={OVERLAP_ENV: None})
    backend = launch(refusal_worker, 2, base, timeout=300, env={OVERLAP_ENV: "1", "TORCH_SYMMMEM": "NCCL"})
    # The medium model needs ~270 MiB per rank for its transport; the GPU is filled to leave 128 MiB free.
    memory = launch(
        refusal_worker,
        2,
        {"cfg": MEDIUM, "leave_free_mib": 128, "transports": ["cuda"]},
        timeout=300,
        env={OVERLAP_ENV: "1"},
    )
    checks = {
        "shared GPU without override refused on both ranks, naming the override": all(
            OVERLAP_ENV in r[n] for r in shared for n in ("cuda", "auto")
        ),
        "'auto' says it found no usable transport": all("'auto' found no usable" in r["auto"] for r in shared),
        "NCCL backend refused on both ranks": all("NCCL backend" in r[n] for r in backend for n in ("cuda", "auto")),
        "too little free memory refused, saying how much is needed": all(
            "need(s)" in r["cuda"] and "MiB is free" in r["cuda"] for r in memory
        ),
    }
    return {"shared_gpu": shared, "backend": backend, "memory": memory, "checks": checks}


def case_memory() -> dict[str, Any]:
    ranks = launch(memory_worker, 2, {"cfg": MEDIUM, "cycles": 2}, timeout=300, env={OVERLAP_ENV: "1"})
    mib = 2**20
    # The ranks share the GPU: free memory falls by both ranks' transports, so compare per rank (half of it).
    cycles = []
    for first, second in zip(ranks[0]["cycles"], ranks[1]["cycles"], strict=True):
        lost = (first["before"]["free"] - first["with_engine"]["free"]) / 2
        given_back = (first["after_close"]["free"] - first["with_engine"]["free"]) / 2
        reported = (first["report"]["total"] + second["report"]["total"]) / 2
        cycles.append({"lost_per_rank": lost, "given_back_per_rank": given_back, "reported_per_rank": reported})
    one, two = cycles[0], cycles[-1]
    return {
        "ranks": ranks,
        "cycles": cycles,
        # What the first engine of a process takes beyond its report and never gives back: CUDA context growth
        # (first-use kernels) and torch's symmetric-memory peer tables (CUDAPeerAllocInfo has no destructor).
        "uncounted_first_engine_per_rank": one["lost_per_rank"] - one["reported_per_rank"],
        "checks": {
            "second engine: what the GPU loses per rank equals the report (within 8 MiB)": abs(
                two["lost_per_rank"] - two["reported_per_rank"]
            )
            <= 8 * mib,
            "second engine: close() gives back everything it took (within 4 MiB)": abs(
                two["given_back_per_rank"] - two["lost_per_rank"]
            )
            <= 4 * mib,
            "first engine: close() gives back at least the report (within 4 MiB)": one["given_back_per_rank"]
            >= one["reported_per_rank"] - 4 * mib,
        },
    }


def case_memory_policy() -> dict[str, Any]:
    from tests.helpers.workers.memory_workers import neither_bound, peak_memory

    plan = [[[256, 128], [192]], [[160], [256, 64]], [[256], [256]]]
    spec = dict(plan=plan, cfg=MEDIUM, policies=["neither", "both"], device="cuda")
    ranks = launch(peak_memory, 2, spec, timeout=300, env={OVERLAP_ENV: "1"})
    sizes = neither_bound(ranks[0]["groups"], MEDIUM, 256, 2)
    staging = max(r["neither"]["transport"].get("staging", 0) for r in ranks)
    bound = sizes["total"] + staging
    neither = [max(r["neither"]["peaks"][1:]) for r in ranks]  # from step 2 on: .grad and AdamW's state exist
    both = [max(r["both"]["peaks"][1:]) for r in ranks]
    return {
        "bound": dict(sizes, staging=staging, bound=bound),
        "peak_neither": neither,
        "peak_both": both,
        "peak_neither_over_bound": [p / bound for p in neither],
        "summaries": {policy: ranks[0][policy]["summary"] for policy in spec["policies"]},
        "checks": {
            "neither: allocator peak within 1.05 x the bound": all(p <= 1.05 * bound for p in neither),
            "both keeps more than neither": all(b > n for b, n in zip(both, neither, strict=True)),
        },
    }


def case_speed() -> dict[str, Any]:
    """The transport's read and accumulate between the two ranks, and the accumulate paths at 1 GiB of source, each
    rank alone, at the default grid caps (the sweep over sizes and grids, and the engine step with each path, are
    stored with the H100 runs in ``benchmarks/gpu/``)."""
    from .accumulate_bench import measure

    ranks = launch(speed_worker, 2, {"numel": 64 * 2**20, "iters": 10}, timeout=300, env={OVERLAP_ENV: "1"})
    paths = measure("cuda", sizes_mib=[1024], sm_shares=[0.25, 0.5])  # every accumulate path, each rank alone
    return {
        "transport": ranks,
        "accumulate_paths": paths,
        "checks": {
            "accumulate sums exactly (fp32)": all(r["accumulate_ok"] for r in ranks),
            "read returns the peer's shard": all(r["read_ok"] for r in ranks),
            **paths["checks"],
        },
    }
