"""Launch-parameter sweep of the accumulate kernel on one GPU (one process): what each (BLOCK, warps, grid) costs.

    python -m tests.gpu.accumulate_sweep [--mib 256] [--out sweep.json]
    TRITON_INTERPRET=1 python -m tests.gpu.accumulate_sweep --device cpu     (the dry run: tiny, checks only)

For fp32 and bf16 sources into an fp32 accumulator, it times the kernel (`odc_accelerate.transport.cuda.kernels`) at
every ``BLOCK`` x ``num_warps`` x grid size below, against ``dst.add_(src)`` (the non-atomic fused add, the ceiling)
in the same run. Every figure is GB/s of source: the median of `REPEATS` timings, each of `CALLS` calls between CUDA
events, after a warm-up. Each configuration's sum is checked exact once (bf16-representable sources, zeroed
accumulator). The atomic instructions in the compiled PTX are listed, to see whether vector reductions were emitted.
The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from typing import Any

import torch

from odc_accelerate.transport.cuda import kernels
from tests.gpu.accumulate_bench import _timer

BLOCKS = (2048, 8192)
WARPS = (4, 8, 16, 32)
#: grid sizes as multiples of the SM count (x 132 on an H100)
GRID_PER_SM = (0.25, 0.5, 1.0, 2.0, 4.0)
REPEATS = 5
CALLS = 10


def _time(fn, device: torch.device) -> float:
    """Median seconds per call of ``fn`` (one call per timing on CPU, where the interpreter is slow)."""
    fn()  # warm-up (compile)
    calls = CALLS if device.type == "cuda" else 1
    timed = _timer(device)
    return statistics.median(timed(fn, calls) / calls for _ in range(REPEATS))


def _atomics(compiled: Any) -> list[str]:
    ptx = getattr(compiled, "asm", {}).get("ptx", "")
    return sorted(set(re.findall(r"\b((?:atom|red)\.[\w.]+)", ptx)))


def _sweep_dtype(kernel: Any, device: torch.device, dtype: torch.dtype, mib: float, sms: int) -> tuple[list, dict]:
    """Every configuration for one source dtype: its rows, and the atomics in each (dtype, BLOCK, warps) PTX."""
    interpret = device.type != "cuda"
    numel = int(mib * 2**20) // dtype.itemsize
    gen = torch.Generator(device=device).manual_seed(numel)
    src = torch.randn(numel, generator=gen, device=device).to(torch.bfloat16).to(dtype)
    dst = torch.randn(numel, generator=gen, device=device)
    name = str(dtype).removeprefix("torch.")
    ceiling = _time(lambda: dst.add_(src), device)
    rows: list[dict[str, Any]] = [{"src": name, "path": "add_", "GBps": src.nbytes / ceiling / 1e9}]
    ptx: dict[str, list[str]] = {}
    for block in BLOCKS:
        for warps in WARPS if not interpret else (4,):
            opts = {} if interpret else {"num_warps": warps, "enable_fp_fusion": False}
            for per_sm in GRID_PER_SM:
                programs = max(1, min(round(sms * per_sm), -(-numel // block)))
                check = torch.zeros_like(dst)
                compiled = kernel[(programs,)](check, src, numel, BLOCK=block, **opts)
                exact = bool(torch.equal(check, src.float()))
                key = f"{name}/B{block}/w{warps}"
                if key not in ptx and not interpret:
                    ptx[key] = _atomics(compiled)
                seconds = _time(
                    lambda p=programs, b=block, o=opts: kernel[(p,)](dst, src, numel, BLOCK=b, **o), device
                )
                rows.append(
                    {
                        "src": name,
                        "path": "kernel",
                        "BLOCK": block,
                        "num_warps": warps,
                        "programs": programs,
                        "per_sm": per_sm,
                        "GBps": src.nbytes / seconds / 1e9,
                        "exact": exact,
                    }
                )
    return rows, ptx


def sweep(device: torch.device, mib: float) -> dict[str, Any]:
    """Both source dtypes; ``rows`` holds every figure, ``ptx_atomics`` the atomic instructions compiled."""
    kernel = kernels._kernel(device.type != "cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    rows, ptx = [], {}
    for dtype in (torch.float32, torch.bfloat16):
        more_rows, more_ptx = _sweep_dtype(kernel, device, dtype, mib, sms)
        rows += more_rows
        ptx.update(more_ptx)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"mib": mib, "sms": sms, "rows": rows, "ptx_atomics": ptx}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--mib", type=float, default=None, help="source size (default 256 on a GPU, 0.01 on CPU)")
    p.add_argument("--out", default=None, help="write every figure here as JSON")
    args = p.parse_args(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    result = sweep(device, args.mib or (256.0 if device.type == "cuda" else 0.01))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    for key, ops in result["ptx_atomics"].items():
        print(f"ptx {key}: {' '.join(ops)}")
    ceilings = {r["src"]: r["GBps"] for r in result["rows"] if r["path"] == "add_"}
    print(f"{'src':9} {'BLOCK':>6} {'warps':>5} {'progs':>5} {'GB/s':>7} {'x add_':>6} exact")
    for r in result["rows"]:
        if r["path"] == "add_":
            print(f"{r['src']:9} {'add_':>6} {'':>5} {'':>5} {r['GBps']:7.0f} {1:6.2f}")
        else:
            ratio = r["GBps"] / ceilings[r["src"]]
            print(
                f"{r['src']:9} {r['BLOCK']:6d} {r['num_warps']:5d} {r['programs']:5d} {r['GBps']:7.0f} {ratio:6.2f} "
                f"{r['exact']}"
            )
    return 0 if all(r.get("exact", True) for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
