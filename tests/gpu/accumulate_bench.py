"""Accumulate paths side by side, per rank alone: the GPU check's speed case calls `measure`.

Two ranks (gloo) on one device. Each rank in turn times every path while the other waits at a barrier (two processes
on one GPU time-slice it, so a figure taken while the peer also runs would include the peer's work). Per source size
(64 MiB to 1 GiB of source on a GPU; tiny on CPU) and source dtype (fp32, bf16), ``dst`` an fp32 accumulator:

* ``index_add_``: the fallback, ``index_add_`` in chunks through the transport's staging pool (its default size);
* ``kernel``: the accumulate kernel, ``accumulate_`` (`odc_accelerate.transport.cuda.kernels`), at its default grid cap
  for the source's dtype;
* ``add_``: ``dst.add_(src)``, the same fused cast-and-add without atomics (the ceiling for adding in place);
* ``copy``: ``buf.copy_(src)``, a plain copy of the source (what pulling a peer's slice costs);
* ``copy_then_add``: ``buf.copy_(src); dst.add_(buf)`` (what a pull reduction costs).

Every figure is GB/s of source (bytes of ``src`` per second). The atomic paths' sums are checked exact (the sources
are bf16-representable, so every partial sum is exact in fp32). The kernel's grid cap is also swept at the largest
size. On CPU the kernel runs under Triton's interpreter (slow; checks this harness, not speed).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from odc_accelerate.testing import launch
from odc_accelerate.transport.cuda.kernels import accumulate_, kernel_available, max_programs
from odc_accelerate.transport.cuda.segments import DEFAULT_STAGING_MIB, StagingPool

PATHS = ("index_add_", "kernel", "add_", "copy", "copy_then_add")
GPU_SIZES_MIB = (64, 256, 1024)
SM_SHARES = (0.125, 0.25, 0.5, 1.0)
#: the speed check, per source dtype: the kernel at its default grid (`kernels.default_sm_share`) adds at least this
#: share of the non-atomic ``add_``'s GB/s at the largest size. On the H100 the grid was chosen on
#: (``benchmarks/gpu/h100-2026-11-27``: ``accumulate_sweep.json``, and ``speed_results.json``'s grid rows) the default
#: grid reached 0.73-0.78 with an fp32 source (a quarter of the SMs) and 0.94-0.96 with a bf16 one (half); each goal
#: sits at least 10% below the lowest of them, room for run-to-run noise.
KERNEL_OVER_ADD_GOAL = {"float32": 0.65, "bfloat16": 0.8}


def _timer(device: torch.device):
    """Seconds of ``fn()`` x ``iters`` on ``device`` (CUDA events on a GPU)."""

    def run(fn, iters: int) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        begin = time.perf_counter()
        for _ in range(iters):
            fn()
        return time.perf_counter() - begin

    return run


def _source(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(numel)
    # bf16-representable values: any sum of a few of them is exact in fp32, whatever the order
    return torch.randn(numel, generator=gen, device=device).to(torch.bfloat16).to(dtype)


def _measure_size(
    device: torch.device, mib: float, dtype: torch.dtype, iters: int, kernel: bool, shares: list[float]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One source size and dtype: GB/s of every path (and the atomic paths' exactness), and the grid-cap sweep."""
    timed = _timer(device)
    numel = int(mib * 2**20) // dtype.itemsize
    src = _source(numel, dtype, device)
    dst = torch.zeros(numel, dtype=torch.float32, device=device)
    buf = torch.empty_like(src)
    chunk = DEFAULT_STAGING_MIB * 2**20 // 8  # the transport's default pool: int32 index + fp32 cast per element
    pool = StagingPool(min(chunk, numel), torch.float32, device, cast=dtype != torch.float32)
    ops = {
        "index_add_": lambda: pool.add(dst, src),
        "kernel": lambda: accumulate_(dst, src),
        "add_": lambda: dst.add_(src),
        "copy": lambda: buf.copy_(src),
        "copy_then_add": lambda: dst.add_(buf.copy_(src)),
    }
    row: dict[str, Any] = {"mib": mib, "src_dtype": str(dtype).removeprefix("torch."), "GBps": {}, "exact": {}}
    for path in PATHS:
        if path == "kernel" and not kernel:
            continue
        dst.zero_()
        ops[path]()  # warm-up (the kernel's compile), counted in the sum below
        seconds = timed(ops[path], iters)
        row["GBps"][path] = iters * src.nbytes / seconds / 1e9
        if path in ("index_add_", "kernel"):
            row["exact"][path] = bool(torch.equal(dst, src.float() * (iters + 1)))
    grid = []
    for share in shares if kernel else ():
        programs = max_programs(device, share)
        seconds = timed(lambda programs=programs: accumulate_(dst, src, programs=programs), iters)
        grid.append(
            {
                "src_dtype": row["src_dtype"],
                "sm_share": share,
                "programs": programs,
                "GBps": iters * src.nbytes / seconds / 1e9,
            }
        )
    return row, grid


def _measure_rank(device: torch.device, sizes_mib: list[float], iters: int, shares: list[float]) -> dict[str, Any]:
    ok, why = kernel_available(device)
    out: dict[str, Any] = {"kernel_available": ok, "kernel_reason": why, "sizes": [], "grid": []}
    for mib in sizes_mib:
        for dtype in (torch.float32, torch.bfloat16):
            # the grid cap is swept at the largest size only
            row, grid = _measure_size(device, mib, dtype, iters, ok, shares if mib == max(sizes_mib) else [])
            out["sizes"].append(row)
            out["grid"].extend(grid)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next rank's turn gets the memory back
    return out


def accumulate_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Launch worker: every rank measures in turn while the others wait at a barrier."""
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU
        device = torch.device("cuda", 0)
    result: dict[str, Any] = {}
    for turn in range(world_size):
        if turn == rank:
            result = _measure_rank(device, spec["sizes_mib"], spec["iters"], spec["sm_shares"])
        dist.barrier()
    return result


def measure(
    device: str = "cuda",
    sizes_mib: list[float] | None = None,
    iters: int = 5,
    sm_shares: list[float] | None = None,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Every accumulate path per rank alone, with ratios and the kernel's goals as ``checks``.

    Args:
        device: ``"cuda"`` (the one GPU, both ranks) or ``"cpu"`` (the kernel under Triton's interpreter).
        sizes_mib: sizes of the source in MiB; defaults to 64, 256 and 1024 on a GPU.
        iters: timed calls per path and size (after one warm-up).
        sm_shares: grid caps of the kernel swept at the largest size.
        timeout: seconds for the whole job.
    """
    spec = {
        "device": device,
        "sizes_mib": list(sizes_mib or GPU_SIZES_MIB),
        "iters": iters,
        "sm_shares": list(sm_shares or SM_SHARES),
    }
    env = {"TRITON_INTERPRET": "1"} if device == "cpu" else None
    ranks = launch(accumulate_worker, 2, spec, timeout=timeout, env=env)
    checks = {
        "accumulate paths: index_add_ and kernel sums exact": all(
            all(row["exact"].values()) for r in ranks for row in r["sizes"]
        ),
        "accumulate paths: the kernel ran": all(r["kernel_available"] for r in ranks),
    }
    # At the largest size, per rank and source dtype: faster than index_add_, and at least `KERNEL_OVER_ADD_GOAL` of
    # the fused add_. How much faster than index_add_ is reported, not bounded: on an H100 index_add_ alone adds ~440
    # GB/s of fp32 source and any in-place add tops out near 1000 (12 bytes moved per 4 read at ~3 TB/s; docs/gpu.md).
    largest = [row for r in ranks for row in r["sizes"] if row["mib"] == max(spec["sizes_mib"])]
    ratios = [
        {
            "src_dtype": row["src_dtype"],
            "kernel_over_index_add": row["GBps"]["kernel"] / row["GBps"]["index_add_"],
            "kernel_over_add": row["GBps"]["kernel"] / row["GBps"]["add_"],
        }
        for row in largest
        if "kernel" in row["GBps"]
    ]
    if device == "cuda":
        checks["kernel faster than index_add_ (largest size, each rank and dtype)"] = bool(ratios) and all(
            x["kernel_over_index_add"] > 1 for x in ratios
        )
        goals = ", ".join(f"{dtype} {goal:g}" for dtype, goal in KERNEL_OVER_ADD_GOAL.items())
        checks[f"kernel at its default grid >= {goals} x the non-atomic add_ (largest size, each rank)"] = bool(
            ratios
        ) and all(x["kernel_over_add"] >= KERNEL_OVER_ADD_GOAL[x["src_dtype"]] for x in ratios)
    return {"ranks": ranks, "ratios_largest_size": ratios, "checks": checks}


def transport_paths_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """The 'cuda' transport's protocol on CPU (`gpu_check.CpuSegmentsCudaTransport`) with the kernel or with the
    ``index_add_`` fallback: its path and why, memory report, and every rank's bf16 slices summed into each owner's
    fp32 accumulator. On rank ``spec["broken_kernel_rank"]`` (if given) the kernel cannot be built, as where Triton
    finds no C compiler: its set-up probe fails there."""
    from odc_accelerate.transport import BufferSpec
    from odc_accelerate.transport.cuda import kernels

    from .check_common import CpuSegmentsCudaTransport

    if rank == spec.get("broken_kernel_rank"):

        def no_compiler(interpret: bool) -> Any:
            raise RuntimeError("emulated: Failed to find C compiler. Please specify via CC environment variable.")

        kernels._kernel = no_compiler
    numel = spec["numel"]
    transport = CpuSegmentsCudaTransport(rank, world_size, timeout=60.0, accumulate_kernel=spec["kernel"])
    own = transport.register({"g": BufferSpec(numel=numel, dtype=torch.bfloat16, accumulated=True)})
    for owner in range(world_size):
        transport.accumulate(owner, "g", _source(numel + 97 * rank, torch.bfloat16, torch.device("cpu"))[:numel])
    transport.barrier()
    expected = sum(
        _source(numel + 97 * r, torch.bfloat16, torch.device("cpu"))[:numel].double() for r in range(world_size)
    )
    out = {
        "path": transport.accumulate_path,
        "reason": transport.accumulate_reason,
        "report": transport.memory_report(),
        "exact": bool(torch.equal(own["g"].double(), expected)),
    }
    transport.barrier()
    del own
    transport.close()
    return out
