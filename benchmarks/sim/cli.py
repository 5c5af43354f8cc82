"""Command line of the simulator: ``python -m benchmarks.sim [scale|hsdp|accumulate|ordered|validate|validate-e2e]
[args]``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.calibration.load import CalibrationError
from benchmarks.sim import crossover, hsdp, ordered
from benchmarks.sim.results import E2E_SFT_RESULTS, ENGINE_RESULTS, TRANSPORT_RESULTS
from benchmarks.sim.scale import MODELS, run_scale
from benchmarks.sim.simulator import H100
from benchmarks.sim.validate import run_validate, run_validate_e2e

DESCRIPTIONS = {
    "scale": "Predicted step times at scale: FSDP2 + random / batch_rebalance / lockstep plan vs ODC + free plan, "
    "Qwen2.5 1.5B / 7B, H100-like figures (assumed), on the same long-tailed steps.",
    "hsdp": "Several nodes: ODC-HSDP vs FSDP2-HSDP vs full sharding (FSDP2, and ODC as the NVSHMEM route would run "
    "it), 16-1024 GPUs, 8 per node, H100-like figures (assumed); and which models fit HSDP in 80 GB.",
    "accumulate": "One node of 8 H100s, SFT and DPO at 1.5B / 7B: the accumulate bandwidth at which ODC overtakes "
    "FSDP2 on NCCL, from the compute and read rate measured on one H100 and a sweep of accumulate bandwidths.",
    "ordered": "One node of 8 H100s, SFT and DPO at 1.5B / 7B: ODC's ordered gradient reduction (one exchange per "
    "step at the measured read rate) beside the atomic one (adds in the backward at measured accumulate rates), and "
    "where each wins.",
    "validate": "Predict the stored engine benchmark's 2-rank CPU arms (python -m benchmarks.engine) and print the "
    "errors.",
    "validate-e2e": "Replay the stored end-to-end benchmark's steps (python -m benchmarks.e2e sft) and print each "
    "arm's predicted and measured step time.",
}


def _add_stored_results(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--transport-json",
        type=Path,
        default=TRANSPORT_RESULTS,
        help="results.json of `python -m benchmarks.transport`: shared-memory figures (default: the stored one)",
    )
    p.add_argument("--repeats", type=int, default=20, help="repeats of each gloo collective")
    p.add_argument("--json", action="store_true", help="print the results as JSON at the end")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv and argv[0] in DESCRIPTIONS else "scale"
    others = "; ".join(f"{name}: {text}" for name, text in DESCRIPTIONS.items())
    p = argparse.ArgumentParser(
        prog=f"python -m benchmarks.sim {cmd}",
        description=DESCRIPTIONS[cmd],
        epilog=f"Subcommands (scale is the default): {others} `python -m benchmarks.sim CMD --help` for each.",
    )
    if cmd == "scale":
        p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
        p.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256, 1024])
        p.add_argument("--dist", default="longalign", help="longalign | swe-smith | pydoc | bimodal")
        p.add_argument("--lengths-file", default=None, help="token counts, one per line (or .npy); overrides --dist")
        p.add_argument("--samples-per-rank", type=int, default=8, help="samples per rank per optimizer step")
        p.add_argument("--steps", type=int, default=None, help="steps per cell (default: 2048 / GPUs, 2..20)")
        p.add_argument("--tflops", type=float, default=H100.flops / 1e12, help="effective TFLOP/s per GPU")
        p.add_argument("--gpus-per-node", type=int, default=H100.gpus_per_node)
        p.add_argument("--intra-gbps", type=float, default=H100.intra_bw / 1e9, help="NVLink GB/s per GPU")
        p.add_argument("--inter-gbps", type=float, default=H100.inter_bw / 1e9, help="network GB/s per GPU")
        p.add_argument("--intra-lat-us", type=float, default=H100.intra_lat * 1e6)
        p.add_argument("--inter-lat-us", type=float, default=H100.inter_lat * 1e6)
        p.add_argument("--contention", type=float, default=1.0, help="factor >= 1 on ODC one-sided traffic")
        p.add_argument("--no-overlap", action="store_true", help="communication does not overlap compute")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument(
            "--calibration",
            default=None,
            help="calibration.json of `python -m benchmarks.calibration`: measured GPU compute time per model, in "
            "place of the FLOP count at --tflops (models it lacks keep the FLOP count; the output names the source)",
        )
        p.add_argument("--json", action="store_true", help="print the results as JSON at the end")
        run = run_scale
    elif cmd == "hsdp":
        hsdp.add_arguments(p)
        run = hsdp.run_hsdp
    elif cmd == "accumulate":
        crossover.add_arguments(p)
        run = crossover.run_crossover
    elif cmd == "ordered":
        ordered.add_arguments(p)
        run = ordered.run_ordered
    elif cmd == "validate-e2e":
        p.add_argument(
            "--e2e-json",
            type=Path,
            default=E2E_SFT_RESULTS,
            help="results.json (or its folder) of `python -m benchmarks.e2e sft` (default: the stored one)",
        )
        p.add_argument("--model-config", default=None, help="config.json of the benchmarked model (default: offline)")
        p.add_argument("--param-bytes", type=int, default=4, help="bytes per parameter (4: the CPU configs' fp32)")
        _add_stored_results(p)
        run = run_validate_e2e
    else:
        p.add_argument(
            "--engine-json",
            type=Path,
            default=ENGINE_RESULTS,
            help="results.json of `python -m benchmarks.engine` (default: the stored one)",
        )
        _add_stored_results(p)
        run = run_validate
    args = p.parse_args(argv)
    try:
        res = run(args)
    except (FileNotFoundError, CalibrationError) as exc:  # missing or unusable input: the message says what to do
        p.exit(2, f"{p.prog}: error: {exc}\n")
    if args.json:
        print(json.dumps(res, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))
    return 0
