"""``python -m benchmarks.sim accumulate``: the accumulate bandwidth at which ODC overtakes FSDP2 on 8 H100s.

One node of 8 H100s, long-tailed SFT and DPO, Qwen2.5-1.5B and 7B shapes. Compute: measured on one H100 where the
stored calibration has the model (``accumulate/calibration_h100.json``), else the FLOP count at the assumed
396 TFLOP/s. ODC reads peers' shards at the read rate measured on that H100 and adds its gradients into their owners
at a swept accumulate bandwidth (GB/s of bf16 gradient source per GPU); FSDP2's all-gathers and reduce-scatters run on
NCCL at an assumed bus bandwidth. Both reduce bf16 gradients (the dtype the measured accumulate rate was taken with).

Arms, on the same steps: FSDP2 on the lockstep plan (the same balancing effort as ODC's plan, its strongest arm)
against ODC on the free plan, once with gradients pushed in every microbatch's backward and once with gradients kept
for the step (only each rank's last microbatch adds into the owners: ODC's step memory policy keeping gradients,
FSDP2's ``no_sync``). For each case: the smallest accumulate bandwidth at which ODC's mean step is no longer than
FSDP2's (`crossover_gbps`, by bisection on the simulator), and both step times along the sweep.

Writes ``results.json``, ``table.txt`` and ``accumulate.png`` (with matplotlib) to ``--out`` (default
``benchmarks/sim/accumulate/``).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.sim.scale import compute_sources, planner_cost
from benchmarks.sim.simulator import H100, Hardware, ModelSpec, simulate
from odc_accelerate.planning import plan_from_costs

RESULTS_DIR = Path(__file__).parent / "accumulate"
#: forward + backward seconds per sequence length measured on one H100 80GB HBM3 (2026-11-26), a verbatim copy of
#: the GPU run's ``calibration.json`` (`python -m benchmarks.calibration --device cuda`); holds 0.5B and 1.5B
CALIBRATION = RESULTS_DIR / "calibration_h100.json"
#: the cuda transport's read of a peer's bf16 shard, measured on that H100 (two ranks time-slicing one GPU)
READ_GBPS = 1468.0
#: the cuda transport's accumulate measured there: index_add_ with a bf16 -> fp32 cast through the staging pool
MEASURED_ACC_GBPS = 70.0
#: NCCL reduce-scatter / all-gather bus bandwidth within an 8 x H100 node (assumed; see `NCCL_SOURCE`)
NCCL_BUS_GBPS = 350.0
NCCL_SOURCE = (
    "assumed: NVIDIA/nccl#1229 reports H100 reduce-scatter bus bandwidths of 360 GB/s at 4 nodes, falling with node "
    "count; no single-node 8 x H100 reduce-scatter figure was found published, and 350 GB/s is taken for both "
    "reduce-scatter and all-gather"
)
SWEEP_GBPS = (35.0, 50.0, 70.0, 100.0, 140.0, 200.0, 280.0, 400.0, 560.0, 800.0, 1100.0, 1468.0)
WORLD = 8
MODES = {"every microbatch": False, "kept for the step": True}


def crossover_gbps(
    step_at: Callable[[float], float], target_s: float, lo: float = 1.0, hi: float = 1e6, rel_tol: float = 1e-4
) -> float | None:
    """The smallest accumulate bandwidth (GB/s) at which ``step_at(bandwidth)`` is no longer than ``target_s``.

    ``step_at`` must not increase with the bandwidth (a faster accumulate never slows a step). Bisection in log
    space to a relative tolerance ``rel_tol``.

    Returns:
        `float | None`: the bandwidth; ``lo`` if ODC is no slower even at ``lo``; None if it is slower even at ``hi``
        (a faster accumulate alone cannot make it overtake).
    """
    if step_at(lo) <= target_s:
        return lo
    if step_at(hi) > target_s:
        return None
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        if step_at(mid) <= target_s:
            hi = mid
        else:
            lo = mid
    return hi


def _capped_lognormal(rng: np.random.Generator, n: int, mean: float, sigma: float, cap: int) -> np.ndarray:
    # mean of the uncapped lognormal; capping trims the tail a little
    mu = math.log(mean) - sigma * sigma / 2
    return np.minimum(rng.lognormal(mu, sigma, n), cap)


def dpo_pair_lengths(rng: np.random.Generator, n: int, cap: int = 32768) -> np.ndarray:
    """Padded row length of ``n`` long-tailed DPO pairs: a long prompt (lognormal, mean 6K) and two answers (mean 1K
    each); both rows are padded to the longer (TRL has no padding-free DPO), capped so that a pair fits 64K tokens."""
    prompt = _capped_lognormal(rng, n, 6000, 0.8, cap)
    answers = _capped_lognormal(rng, 2 * n, 1000, 0.6, 4096).reshape(2, n)
    return np.clip(prompt + answers.max(axis=0), 64, cap).astype(np.int64)


def workload_steps(workload: str, model: ModelSpec, rng: np.random.Generator, steps: int, per_rank: int) -> list[dict]:
    """Every step's lengths and the two arms' plans; a DPO pair becomes two rows of its padded length."""
    from benchmarks.planning.distributions import distributions

    budget = 65536
    n = WORLD * per_rank
    cost = planner_cost(model)
    draw_sft = distributions()["longalign"][2]
    out = []
    for _ in range(steps):
        if workload == "sft":
            lengths = draw_sft(rng, n)
            costs, tokens = cost(lengths), lengths
        else:
            lengths = dpo_pair_lengths(rng, n)
            costs, tokens = 2 * cost(lengths), 2 * lengths
        plans = {name: plan_from_costs(costs, tokens, WORLD, budget, plan=name) for name in ("lockstep", "free")}
        if workload == "dpo":
            rows = lambda plan: [[[r for i in mb for r in (2 * i, 2 * i + 1)] for mb in rank] for rank in plan]  # noqa: E731
            plans = {name: rows(plan) for name, plan in plans.items()}
            lengths = np.repeat(lengths, 2)
        out.append({"lengths": lengths, "plans": plans})
    return out


def _mean_step(steps: list[dict], arm: str, model: ModelSpec, hw: Hardware, system: str, **kwargs: Any) -> float:
    return float(np.mean([simulate(s["plans"][arm], s["lengths"], model, hw, system, **kwargs).step_s for s in steps]))


def _odc_step(gbps: float, *, steps: list[dict], model: ModelSpec, hw: Hardware, **kwargs: Any) -> float:
    """ODC's mean step with an accumulate bandwidth of ``gbps`` GB/s."""
    return _mean_step(steps, "free", model, hw.with_(p2p_acc_intra_bw=gbps * 1e9), "odc", **kwargs)


def hardware(tflops: float, read_gbps: float, nccl_gbps: float) -> Hardware:
    """One node of 8 H100s: NCCL collectives at ``nccl_gbps`` bus bandwidth, ODC reads at ``read_gbps``."""
    return H100.with_(flops=tflops * 1e12, intra_bw=nccl_gbps * 1e9, p2p_intra_bw=read_gbps * 1e9)


def run_crossover(args: argparse.Namespace) -> dict[str, Any]:
    """Simulate every case, print the table, write the results (and the figure) to ``args.out``."""
    hw = hardware(args.tflops, args.read_gbps, args.nccl_gbps)
    calibration = Path(args.calibration).resolve()
    if calibration.is_relative_to(Path.cwd()):  # named relative to the repository root in the stored results
        calibration = calibration.relative_to(Path.cwd())
    models, sources = compute_sources(args.models, str(calibration), args.tflops)
    rng = np.random.default_rng(args.seed)
    cases = []
    for name in args.models:
        model = replace(models[name], grad_bytes=2, param_bytes=2)
        for workload in args.workloads:
            steps = workload_steps(workload, model, rng, args.steps, args.samples_per_rank)
            reference = workload == "dpo"
            for (mode, kept), overlap in itertools.product(MODES.items(), (True, False)):
                kw = dict(accumulate_locally=kept, reference_forward=reference)
                case_hw = hw.with_(overlap=overlap)
                fsdp2 = _mean_step(steps, "lockstep", model, case_hw, "fsdp2", **kw)
                odc = functools.partial(_odc_step, steps=steps, model=model, hw=case_hw, **kw)
                cases.append(
                    {
                        "model": name,
                        "workload": workload,
                        "gradients": mode,
                        "overlap": overlap,
                        "fsdp2_step_s": fsdp2,
                        "odc_step_s": {str(g): odc(g) for g in args.sweep},
                        "odc_step_s_at_measured_accumulate": odc(MEASURED_ACC_GBPS),
                        "odc_step_s_unbounded_accumulate": odc(1e9),
                        "crossover_gbps": crossover_gbps(odc, fsdp2),
                    }
                )
    result = {
        "what": "mean simulated step time, FSDP2 (lockstep plan, NCCL) vs ODC (free plan) on 8 H100s, by ODC's "
        "accumulate bandwidth; crossover = the smallest accumulate bandwidth at which ODC is no slower",
        "inputs": {
            "gpus": WORLD,
            "compute": sources,
            "calibration": f"{CALIBRATION.name}: copy of the calibration.json measured on one H100 80GB HBM3 on "
            "2026-11-26 (torch 2.11.0+cu130, bf16, activation checkpointing, batch 1)",
            "read_gbps": args.read_gbps,
            "read_source": "the cuda transport's read, measured on one H100 (two ranks time-slicing it)",
            "measured_accumulate_gbps": MEASURED_ACC_GBPS,
            "nccl_bus_gbps": args.nccl_gbps,
            "nccl_source": NCCL_SOURCE,
            "gradient_dtype": "bf16 (2 bytes), reduced and accumulated alike by both systems",
            "sft_lengths": "lognormal sigma=0.8, mean 16.5K capped at 64K (LongAlign-like)",
            "dpo_lengths": "pairs: prompt lognormal mean 6K sigma 0.8, answers mean 1K sigma 0.6 capped at 4K, "
            "both rows padded to the longer, capped at 32K; a reference forward per microbatch",
            "samples_per_rank_per_step": args.samples_per_rank,
            "steps": args.steps,
            "seed": args.seed,
            "microbatch_budget_tokens": 65536,
            "sweep_gbps": list(args.sweep),
        },
        "cases": cases,
    }
    table = format_table(result)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "table.txt").write_text(table + "\n")
    if plot(result, args.out / "accumulate.png"):
        print(f"figure: {args.out / 'accumulate.png'}")
    return result


def format_table(result: dict[str, Any]) -> str:
    """The cases as a Markdown table, one row per model, workload and gradient mode: FSDP2's step, ODC's at the
    measured accumulate rate and with a free accumulate, and the crossover, with communication overlapped and not."""

    def crossing(c: dict[str, Any]) -> str:
        return "never" if c["crossover_gbps"] is None else f"{c['crossover_gbps']:.0f} GB/s"

    acc = f"{MEASURED_ACC_GBPS:.0f} GB/s"
    lines = [
        f"| model | workload | gradients | FSDP2 step s | ODC step s at {acc} | ODC step s, free accumulate | ODC "
        f"overtakes FSDP2 at | not overlapped: FSDP2 step s | ODC step s at {acc} | ODC overtakes FSDP2 at |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_case = {(c["model"], c["workload"], c["gradients"], c["overlap"]): c for c in result["cases"]}
    for (model, workload, gradients, overlap), on in by_case.items():
        if not overlap:
            continue
        off = by_case[(model, workload, gradients, False)]
        lines.append(
            f"| {model} | {workload.upper()} | {gradients} | {on['fsdp2_step_s']:.2f} | "
            f"{on['odc_step_s_at_measured_accumulate']:.2f} | {on['odc_step_s_unbounded_accumulate']:.2f} | "
            f"{crossing(on)} | {off['fsdp2_step_s']:.2f} | {off['odc_step_s_at_measured_accumulate']:.2f} | "
            f"{crossing(off)} |"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> bool:
    """ODC's step over FSDP2's against the accumulate bandwidth, one line per case, communication overlapped with
    compute (left) and not (right); False without matplotlib."""
    from benchmarks.e2e.plot import pyplot

    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    styles = {"every microbatch": "-", "kept for the step": "--"}
    colors = {
        ("1.5b", "sft"): "tab:blue",
        ("1.5b", "dpo"): "tab:cyan",
        ("7b", "sft"): "tab:red",
        ("7b", "dpo"): "tab:orange",
    }
    for ax, overlap in zip(axes, (True, False), strict=True):
        for c in (c for c in result["cases"] if c["overlap"] == overlap):
            sweep = sorted(float(g) for g in c["odc_step_s"])
            ax.plot(
                sweep,
                [c["odc_step_s"][str(g)] / c["fsdp2_step_s"] for g in sweep],
                styles[c["gradients"]],
                color=colors.get((c["model"], c["workload"]), "gray"),
                marker="o",
                markersize=3,
                label=f"{c['model']} {c['workload'].upper()}, gradients {c['gradients']}",
            )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axvline(MEASURED_ACC_GBPS, color="gray", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("ODC accumulate bandwidth per GPU (GB/s of bf16 gradient source)")
        ax.set_title(f"communication {'overlapped with' if overlap else 'added to'} compute", fontsize=9)
    axes[0].set_ylabel("ODC step / FSDP2 step (below 1: ODC faster)")
    axes[0].legend(fontsize=7)
    inputs = result["inputs"]
    fig.suptitle(
        f"8 H100s, simulated: ODC reads at {inputs['read_gbps']:.0f} GB/s (measured); FSDP2 on NCCL at "
        f"{inputs['nccl_bus_gbps']:.0f} GB/s bus bandwidth (assumed); dotted: the accumulate rate measured with "
        "index_add_",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=["1.5b", "7b"], choices=["1.5b", "7b"])
    p.add_argument("--workloads", nargs="+", default=["sft", "dpo"], choices=["sft", "dpo"])
    p.add_argument("--sweep", type=float, nargs="+", default=list(SWEEP_GBPS), help="accumulate GB/s to tabulate")
    p.add_argument("--read-gbps", type=float, default=READ_GBPS, help="ODC read bandwidth per GPU (measured)")
    p.add_argument("--nccl-gbps", type=float, default=NCCL_BUS_GBPS, help="NCCL bus bandwidth (assumed)")
    p.add_argument("--tflops", type=float, default=H100.flops / 1e12, help="effective TFLOP/s of uncalibrated models")
    p.add_argument("--calibration", type=Path, default=CALIBRATION, help="measured compute (calibration.json)")
    p.add_argument("--samples-per-rank", type=int, default=8, help="samples (DPO: pairs) per rank per step")
    p.add_argument("--steps", type=int, default=20, help="steps per case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for results.json, table.txt, the PNG")
    p.add_argument("--json", action="store_true", help="print the results as JSON at the end")
