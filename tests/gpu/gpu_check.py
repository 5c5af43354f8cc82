"""Engine-level check of the 'cuda' transport on one GPU: ``scripts/gpu_check.sh [OUT_DIR]``.

Runs 2 processes on the one GPU (gloo process group, ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``; 8 in
``ranks8``), each case in fresh processes, and writes ``results.json`` and ``summary.txt`` to the output folder:
``environment`` (torch, CUDA, the GPU and what the transport's device checks see), then the cases by family:
``parity`` and ``ranks8`` (`check_parity`), ``ordered`` (`check_ordered`), ``refusals``, ``memory``,
``memory_policy`` and ``speed`` (`check_resources`); what they share is in `check_common`.

With ``--device cpu`` the parity, ranks8 and ordered cases run on CPU: the ``shm`` transport (parity) and the 'cuda'
transport's protocol over shared memory (`check_common.CpuSegmentsCudaTransport`), which checks this harness and the
engine's handling of widened accumulators without a GPU. The exit code is 0 when every check passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
import traceback
from typing import Any

import numpy as np
import torch

from .check_ordered import case_ordered
from .check_parity import case_parity, case_ranks8
from .check_resources import case_memory, case_memory_policy, case_refusals, case_speed

CASES = ("refusals", "parity", "ranks8", "memory", "ordered", "memory_policy", "speed")


CPU_CASES = ("parity", "ranks8", "ordered")  # with --device cpu: over shared memory instead of the GPU


def environment() -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_memory=props.total_memory, device_count=torch.cuda.device_count())
        from odc_accelerate.transport.cuda import local_device_facts

        out["facts"] = dataclasses.asdict(local_device_facts(torch.device("cuda", 0)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json and summary.txt")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--cases", default=None, help=f"comma-separated subset of {','.join(CASES)}")
    args = p.parse_args(argv)
    available = CASES if args.device == "cuda" else CPU_CASES
    cases = args.cases.split(",") if args.cases else list(available)
    unknown = [c for c in cases if c not in available]
    if unknown:
        p.error(f"case(s) {unknown} do not run on {args.device}; choose from {', '.join(available)}")
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, Any] = {"environment": environment()}
    runners = {
        "refusals": case_refusals,
        "parity": lambda: case_parity(args.device),
        "ranks8": lambda: case_ranks8(args.device),
        "memory": case_memory,
        "ordered": lambda: case_ordered(args.device),
        "memory_policy": case_memory_policy,
        "speed": case_speed,
    }
    for name in cases:
        start = time.perf_counter()
        try:
            results[name] = runners[name]()
        except Exception:
            results[name] = {"error": traceback.format_exc(), "checks": {"ran": False}}
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
        _write(args.out, results)
    failed = [f"{case}: {check}" for case in cases for check, ok in results[case]["checks"].items() if not ok]
    with open(os.path.join(args.out, "summary.txt")) as f:
        sys.stdout.write(f.read())
    return 1 if failed else 0


def _write(out: str, results: dict[str, Any]) -> None:
    def plain(x: Any) -> Any:
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in x.items() if k not in ("grads", "params")}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, (np.floating, np.integer)):
            return x.item()
        if isinstance(x, (str, int, float, bool)) or x is None:
            return x
        return str(x)

    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(plain(results), f, indent=1)
    lines = [f"torch {torch.__version__}, CUDA {torch.version.cuda}, {results['environment'].get('gpu', 'no GPU')}"]
    for case, res in results.items():
        if case == "environment":
            continue
        lines.append(f"[{case}] {res.get('seconds', '?')} s")
        for check, ok in res.get("checks", {}).items():
            lines.append(f"  {'PASS' if ok else 'FAIL'}  {check}")
        for figure, value in res.get("figures", {}).items():  # measured, stored, never checked
            lines.append(f"  ----  {figure}: {value}")
        if "error" in res:
            lines.append("  " + res["error"].strip().splitlines()[-1])
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    # Run through the package (`from tests.gpu.gpu_check import main`) so that the spawned ranks import
    # the workers from their modules' real names; scripts/gpu_check.sh does.
    sys.exit(main())
