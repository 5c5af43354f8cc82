"""``python -m benchmarks.sim ordered``: ODC's ordered gradient reduction beside the atomic one on 8 H100s.

The cases of ``python -m benchmarks.sim accumulate`` (`benchmarks.sim.crossover`: one node of 8 H100s, long-tailed SFT
and DPO at Qwen2.5-1.5B and 7B shapes, the same steps, compute measured on one H100 where the stored calibration has
the model, NCCL's bus bandwidth assumed), with ODC on the free plan reducing its gradients two ways:

* ``atomic``: adds into the owners in the backward, every microbatch's or only the last one's (gradients kept for the
  step), at an accumulate bandwidth measured on one H100: `crossover.MEASURED_ACC_GBPS` (``index_add_`` through the
  transport, the simulator's stored figure) and `KERNEL_ACC_GBPS` (the accumulate kernel);
* ``ordered``: no adds in the backward; one exchange per step after the slowest rank, each owner reading its shard's
  contributions from the peers at `crossover.READ_GBPS`, the cuda transport's read measured on that H100 (the
  simulator's stored read rate), not overlapped with anything, between two barriers.

FSDP2 on the lockstep plan is printed beside them. Writes ``results.json`` and ``table.txt`` to ``--out`` (default
``benchmarks/sim/ordered/``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.sim import crossover
from benchmarks.sim.scale import compute_sources
from benchmarks.sim.simulator import H100, Hardware, ModelSpec, simulate

RESULTS_DIR = Path(__file__).parent / "ordered"
#: the accumulate kernel on one H100, bf16 source into fp32 at half the SMs (its default grid for 16-bit sources),
#: one rank alone (docs/gpu.md, 2026-11-27)
KERNEL_ACC_GBPS = 470.0
ATOMIC_RATES = {
    "index_add_": (crossover.MEASURED_ACC_GBPS, "the cuda transport's index_add_ accumulate, both ranks time-slicing "
                   "one H100 (2026-11-26; the simulator's stored accumulate rate)"),
    "kernel": (KERNEL_ACC_GBPS, "the accumulate kernel, bf16 source, half the SMs, one rank alone on one H100 "
               "(2026-11-27, docs/gpu.md)"),
}  # fmt: skip


def _mean(steps: list[dict], arm: str, model: ModelSpec, hw: Hardware, system: str, **kwargs: Any) -> dict[str, float]:
    runs = [simulate(s["plans"][arm], s["lengths"], model, hw, system, **kwargs) for s in steps]
    return {
        "step_s": float(np.mean([r.step_s for r in runs])),
        "exchange_s": float(np.mean([r.exchange_s for r in runs])),
    }


def simulate_case(steps: list[dict], model: ModelSpec, hw: Hardware, *, reference_forward: bool) -> dict[str, Any]:
    """Mean step of FSDP2 (lockstep), ODC atomic at each rate and gradient mode, and ODC ordered, on ``steps``."""
    kw = dict(reference_forward=reference_forward)
    atomic = {}
    for label, (gbps, _) in ATOMIC_RATES.items():
        acc_hw = hw.with_(p2p_acc_intra_bw=gbps * 1e9)
        for mode, kept in crossover.MODES.items():
            run = _mean(steps, "free", model, acc_hw, "odc", accumulate_locally=kept, **kw)
            atomic[f"{label}, {mode}"] = run["step_s"]
    ordered = _mean(steps, "free", model, hw, "odc", reduction="ordered", **kw)
    return {
        "fsdp2_step_s": _mean(steps, "lockstep", model, hw, "fsdp2", **kw)["step_s"],
        "atomic_step_s": atomic,
        "ordered_step_s": ordered["step_s"],
        "ordered_exchange_s": ordered["exchange_s"],
    }


def winner(case: dict[str, Any], rate: str) -> str:
    """Which reduction is faster at the atomic ``rate`` (the better of its two gradient modes), and by how much."""
    atomic = min(s for arm, s in case["atomic_step_s"].items() if arm.startswith(f"{rate},"))
    ordered = case["ordered_step_s"]
    if ordered < atomic:
        return f"ordered, {100 * (atomic / ordered - 1):.2f}%"
    return f"atomic, {100 * (ordered / atomic - 1):.2f}%"


def run_ordered(args: argparse.Namespace) -> dict[str, Any]:
    """Simulate every case, print the table, write ``results.json`` and ``table.txt`` to ``args.out``."""
    hw = crossover.hardware(args.tflops, args.read_gbps, args.nccl_gbps)
    calibration = Path(args.calibration).resolve()
    if calibration.is_relative_to(Path.cwd()):  # named relative to the repository root in the stored results
        calibration = calibration.relative_to(Path.cwd())
    models, sources = compute_sources(args.models, str(calibration), args.tflops)
    rng = np.random.default_rng(args.seed)
    cases = []
    for name in args.models:
        model = replace(models[name], grad_bytes=2, param_bytes=2)
        for workload in args.workloads:
            steps = crossover.workload_steps(workload, model, rng, args.steps, args.samples_per_rank)
            for overlap in (True, False):
                case = simulate_case(steps, model, hw.with_(overlap=overlap), reference_forward=workload == "dpo")
                cases.append({"model": name, "workload": workload, "overlap": overlap, **case})
    result = {
        "what": "mean simulated step time on 8 H100s: ODC (free plan) with the atomic reduction (adds in the "
        "backward) and with the ordered one (one exchange per step at the read rate), FSDP2 (lockstep plan) beside",
        "inputs": {
            "gpus": crossover.WORLD,
            "compute": sources,
            "read_gbps": args.read_gbps,
            "read_source": "the cuda transport's read, measured on one H100 (two ranks time-slicing it); the "
            "simulator's stored read rate (benchmarks.sim.crossover.READ_GBPS)",
            "atomic_gbps": {label: {"gbps": g, "source": src} for label, (g, src) in ATOMIC_RATES.items()},
            "nccl_bus_gbps": args.nccl_gbps,
            "nccl_source": crossover.NCCL_SOURCE,
            "gradient_dtype": "bf16 (2 bytes): the atomic adds' source and the ordered contributions alike",
            "not_modelled": "the local adds of each rank's microbatches into its own buffers and the owner's adds of "
            "what it read (ordered); the adds' interference with the backward (atomic)",
            "samples_per_rank_per_step": args.samples_per_rank,
            "steps": args.steps,
            "seed": args.seed,
        },
        "cases": cases,
    }
    table = format_table(result)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "table.txt").write_text(table + "\n")
    return result


def format_table(result: dict[str, Any]) -> str:
    """One Markdown row per model, workload and overlap: every arm's mean step and which reduction wins."""
    rates = {label: f"{gbps:.0f} GB/s" for label, (gbps, _) in ATOMIC_RATES.items()}
    modes = {"every microbatch": "every mb", "kept for the step": "kept"}
    atomic_cols = [f"atomic {rates[r]} {short}" for r in rates for short in modes.values()]
    head = ["model", "workload", "overlap", "FSDP2", *atomic_cols, "ordered", "exchange ms"]
    head += [f"faster vs atomic {rates[r]}" for r in rates]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in result["cases"]:
        row = [c["model"], c["workload"].upper(), "on" if c["overlap"] else "off", f"{c['fsdp2_step_s']:.3f}"]
        row += [f"{c['atomic_step_s'][f'{r}, {m}']:.3f}" for r in rates for m in modes]
        row += [f"{c['ordered_step_s']:.3f}", f"{1000 * c['ordered_exchange_s']:.1f}"]
        row += [winner(c, r) for r in rates]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=["1.5b", "7b"], choices=["1.5b", "7b"])
    p.add_argument("--workloads", nargs="+", default=["sft", "dpo"], choices=["sft", "dpo"])
    p.add_argument(
        "--read-gbps", type=float, default=crossover.READ_GBPS, help="ODC read bandwidth per GPU (measured)"
    )
    p.add_argument("--nccl-gbps", type=float, default=crossover.NCCL_BUS_GBPS, help="NCCL bus bandwidth (assumed)")
    p.add_argument("--tflops", type=float, default=H100.flops / 1e12, help="effective TFLOP/s of uncalibrated models")
    p.add_argument("--calibration", type=Path, default=crossover.CALIBRATION, help="measured compute")
    p.add_argument("--samples-per-rank", type=int, default=8, help="samples (DPO: pairs) per rank per step")
    p.add_argument("--steps", type=int, default=20, help="steps per case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for results.json and table.txt")
    p.add_argument("--json", action="store_true", help="print the results as JSON at the end")
