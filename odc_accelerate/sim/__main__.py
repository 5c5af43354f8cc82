"""``python -m odc_accelerate.sim [scale|validate|validate-e2e] [args]``: predicted step times for FSDP2 and ODC.

``scale`` (default): for each model (Qwen2.5-1.5B / 7B configs) and world size (8, 64, 256, 1024 GPUs, 8 per node,
H100-like figures), plans the SAME steps of long-tailed lengths (LongAlign-like by default, or ``--lengths-file``)
with four arms and simulates them: FSDP2 + random sampling (Trainer default, one sample per microbatch), FSDP2 +
transformers' BatchRebalanceSampler, FSDP2 + this package's lockstep plan, ODC + this package's ODC plan.

``validate``: predicts the engine benchmark's 2-rank CPU arms (``python -m odc_accelerate.bench engine``) from
calibrations that do not use the predicted figures: compute FLOP/s from the benchmark's no-communication ``limit``
arm (balanced), gloo collective cost from a live micro-benchmark (`calibrate.measure_gloo`), shared-memory read /
accumulate bandwidth and latency from the transport benchmark table, and one per-group hook overhead fitted on ODC
balanced; predicts FSDP2 balanced / imbalanced, ODC imbalanced and limit imbalanced, and prints % errors.

``validate-e2e``: replays the steps recorded by the end-to-end benchmark (``python -m odc_accelerate.bench sft``) and
predicts each FSDP2 / ODC arm's step time (see `odc_accelerate.sim.e2e`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from ..balance import flops_cost, plan_from_costs
from . import H100, QWEN2_5_1_5B, QWEN2_5_7B, ModelSpec, simulate

MODELS = {"1.5b": QWEN2_5_1_5B, "7b": QWEN2_5_7B}
ARMS = ("FSDP2 + random", "FSDP2 + batch_rebalance", "FSDP2 + plan lockstep", "ODC + plan odc")
PAPER_SFT_MAX_SPEEDUP = 1.36  # "Revisiting Parameter Server in LLM Post-Training": up to 36% faster SFT than FSDP


def _planner_cost(model: ModelSpec):
    # The planner balances with the same FLOP model the simulator charges (what cost="auto" derives from a config).
    return flops_cost(
        model.layers, model.hidden, model.intermediate, model.heads, model.kv_heads, model.vocab, model.head_dim,
        model.gated_mlp,
    )  # fmt: skip


def _random_plan(n: int, world: int) -> list[list[list[int]]]:
    # Shuffled samples, one per microbatch; consecutive samples go to ranks 0..W-1 in turn (accelerate's sharding).
    return [[[k * world + r] for k in range(n // world)] for r in range(world)]


def arm_plans(lengths: np.ndarray, world: int, samples_per_step: int, budget: int, model: ModelSpec) -> dict:
    """Every arm's plan for every step of ``lengths`` (consecutive chunks of ``samples_per_step``)."""
    from .._transformers_compat import batch_rebalance_global_plans

    steps = lengths.size // samples_per_step
    cost = _planner_cost(model)
    grad_accum = samples_per_step // world
    brs = batch_rebalance_global_plans(
        lengths[: steps * samples_per_step].tolist(), effective_batch_size=samples_per_step, dp_size=world,
        grad_accum=grad_accum,
    )  # fmt: skip
    out: dict[str, list] = {arm: [] for arm in ARMS}
    for s in range(steps):
        sl = slice(s * samples_per_step, (s + 1) * samples_per_step)
        tok = lengths[sl]
        costs = cost(tok)
        out["FSDP2 + random"].append(_random_plan(samples_per_step, world))
        off = s * samples_per_step
        out["FSDP2 + batch_rebalance"].append([[[i - off for i in mb] for mb in rank] for rank in brs[s]])
        out["FSDP2 + plan lockstep"].append(plan_from_costs(costs, tok, world, budget, "lockstep"))
        out["ODC + plan odc"].append(plan_from_costs(costs, tok, world, budget, "odc"))
    return out


def _draw_lengths(args: argparse.Namespace, rng: np.random.Generator, n: int) -> tuple[np.ndarray, str, int]:
    if args.lengths_file:
        path = args.lengths_file
        pool = np.load(path) if path.endswith(".npy") else np.loadtxt(path, dtype=np.int64)
        pool = np.asarray(pool, dtype=np.int64).ravel()
        return rng.choice(pool, n), f"{path} ({pool.size} lengths, drawn with replacement)", int(pool.max())
    from ..bench.balance import distributions

    desc, budget, draw = distributions()[args.dist]
    return draw(rng, n), desc, budget


def run_scale(args: argparse.Namespace) -> dict:
    hw = H100.with_(
        flops=args.tflops * 1e12,
        gpus_per_node=args.gpus_per_node,
        intra_bw=args.intra_gbps * 1e9,
        inter_bw=args.inter_gbps * 1e9,
        intra_lat=args.intra_lat_us * 1e-6,
        inter_lat=args.inter_lat_us * 1e-6,
        overlap=not args.no_overlap,
        contention=args.contention,
    )
    rng = np.random.default_rng(args.seed)
    print(
        f"Simulated step times: {hw.flops / 1e12:.0f} TFLOP/s effective per GPU, {hw.gpus_per_node} GPUs/node, "
        f"intra {hw.intra_bw / 1e9:.0f} GB/s ({hw.intra_lat * 1e6:.0f} us/hop), inter {hw.inter_bw / 1e9:.0f} GB/s "
        f"({hw.inter_lat * 1e6:.0f} us/hop), overlap={hw.overlap}, contention={hw.contention}, bf16 params, fp32 "
        f"grad reduce; {args.samples_per_rank} samples per rank per step"
    )
    header = (
        f"{'model':6s} {'GPUs':>5s} {'arm':24s} {'step s':>8s} {'Mtok/s':>8s} {'bubble%':>8s} {'vs rand':>8s} "
        f"{'vs BRS':>7s} {'vs lock':>7s} {'/limit':>7s}"
    )
    results: dict = {}
    printed_dist = False
    for name in args.models:
        model = MODELS[name]
        results[name] = {}
        for world in args.worlds:
            spr = args.samples_per_rank * world
            steps = args.steps or max(2, min(20, 2048 // world))
            lengths, desc, budget = _draw_lengths(args, rng, steps * spr)
            if not printed_dist:
                print(f"lengths: {desc}; microbatch budget {budget} tokens (planner arms)")
                print(header)
                print("-" * len(header))
                printed_dist = True
            t0 = time.perf_counter()
            plans = arm_plans(lengths, world, spr, budget, model)
            t_plan = time.perf_counter() - t0
            t0 = time.perf_counter()
            agg = {}
            for arm in ARMS:
                system = "odc" if arm.startswith("ODC") else "fsdp2"
                res = [
                    simulate(p, lengths[s * spr : (s + 1) * spr], model, hw, system) for s, p in enumerate(plans[arm])
                ]
                step = float(np.mean([r.step_s for r in res]))
                tokens = float(np.sum([r.tokens for r in res]))
                limit = float(np.mean([r.limit_s for r in res]))
                busy = float(np.mean([r.busy_s.mean() for r in res]))
                agg[arm] = {
                    "step_s": step,
                    "tokens_per_s": tokens / (step * len(res)),
                    "bubble_pct": 100 * (1 - busy / step),
                    "over_limit": step / limit,
                }
            t_sim = time.perf_counter() - t0
            base, brs = agg["FSDP2 + random"]["tokens_per_s"], agg["FSDP2 + batch_rebalance"]["tokens_per_s"]
            lock = agg["FSDP2 + plan lockstep"]["tokens_per_s"]
            for arm in ARMS:
                a = agg[arm]
                a["speedup_vs_random"] = a["tokens_per_s"] / base
                a["speedup_vs_brs"] = a["tokens_per_s"] / brs
                a["speedup_vs_lockstep"] = a["tokens_per_s"] / lock
                print(
                    f"{name:6s} {world:5d} {arm:24s} {a['step_s']:8.2f} {a['tokens_per_s'] / 1e6:8.3f} "
                    f"{a['bubble_pct']:8.1f} {a['speedup_vs_random']:8.3f} {a['speedup_vs_brs']:7.3f} "
                    f"{a['speedup_vs_lockstep']:7.3f} {a['over_limit']:7.3f}"
                )
            print(f"{'':6s} {'':5s} ({steps} steps; planning {t_plan:.1f} s, simulation {t_sim:.2f} s)")
            results[name][world] = agg
    best = max(results[m][w]["ODC + plan odc"]["speedup_vs_random"] for m in results for w in results[m])
    best_brs = max(results[m][w]["ODC + plan odc"]["speedup_vs_brs"] for m in results for w in results[m])
    lock = [results[m][w]["ODC + plan odc"]["speedup_vs_lockstep"] for m in results for w in results[m]]
    print(
        f"ODC + plan vs FSDP2 + random: up to {best:.2f}x; vs FSDP2 + batch_rebalance: up to {best_brs:.2f}x; vs "
        f"FSDP2 + lockstep plan (same balancing effort): {min(lock):.2f}x-{max(lock):.2f}x "
        f"(paper, SFT: up to {PAPER_SFT_MAX_SPEEDUP:.2f}x over FSDP)"
    )
    return results


# ------------------------------------------------------------------------------------------------------------------
# Validation against the 2-rank CPU engine benchmark
# ------------------------------------------------------------------------------------------------------------------

# `python -m odc_accelerate.bench engine` as published in the README (2 CPU ranks, one thread each).
README_ENGINE = {
    "fsdp_balanced_ms": 1574.4,
    "fsdp_imbalanced_ms": 2120.8,
    "odc_balanced_ms": 1200.0,
    "odc_imbalanced_ms": 1171.2,
    "limit_balanced_ms": 1046.1,
    "limit_imbalanced_ms": 1047.9,
    "config": {"layers": 8, "dim": 256, "heads": 4, "vocab": 2048, "long": 1024, "short": 256},
}
# `python -m odc_accelerate.bench transport`, shm row of the README table: 1 MiB read / accumulate MB/s, 64 B
# read / accumulate latency and barrier (us). The engine's per-peer transfers are 1-2 MB, nearest the 1 MiB column.
README_SHM = {"read_MBps": 44391.0, "acc_MBps": 32333.0, "read_us": 1.0, "acc_us": 2.9, "barrier_us": 21.6}


def _engine_cases(cfg: dict) -> tuple[np.ndarray, dict]:
    lengths = np.array([cfg["long"], cfg["short"]])
    return lengths, {"balanced": [[[0], [1]], [[0], [1]]], "imbalanced": [[[0], [1]], [[1], [0]]]}


def run_validate(args: argparse.Namespace) -> dict:
    from .calibrate import cpu_hardware, measure_gloo

    measured = dict(README_ENGINE)
    source = "README engine table"
    if args.engine_json:
        with open(args.engine_json) as f:
            line = [ln for ln in f.read().splitlines() if ln.startswith("{")][-1]
        measured = json.loads(line)
        source = args.engine_json
    cfg = measured["config"]
    model = ModelSpec(
        layers=cfg["layers"], hidden=cfg["dim"], intermediate=4 * cfg["dim"], heads=cfg["heads"], vocab=cfg["vocab"],
        gated_mlp=False, param_bytes=4, grad_bytes=4,
    )  # fmt: skip
    lengths, plans = _engine_cases(cfg)
    _, _, params = model.group_costs()

    # 1. Compute: FLOP/s from the limit arm (balanced: both ranks run [long, short], no communication).
    flop = float((_planner_cost(model)(lengths)).sum())
    flops = flop / (measured["limit_balanced_ms"] / 1e3)
    # 2. gloo collectives: live micro-benchmark at this model's group sizes (fp32), fitted to lat + bytes / bw.
    sizes = sorted({int(p * 4) for p in params} | {2**18, 2**23})
    gloo = measure_gloo(sizes, repeats=args.repeats)
    hw = cpu_hardware(flops, gloo, README_SHM, world=2)
    ag_lat, ag_bw = gloo["ag_fit"]
    rs_lat, rs_bw = gloo["rs_fit"]
    # 3. Per-group hook overhead (copy-in / copy-out, ODC's locked adds, fold and publish, spread per group): the
    # one figure fitted on an arm that is also reported, ODC balanced. Solved in closed form: the step is linear in it.
    base = simulate(plans["balanced"], lengths, model, hw, "odc").step_s
    slope = simulate(plans["balanced"], lengths, model, hw.with_(fixed_per_group=1.0), "odc").step_s - base
    fixed = max(0.0, (measured["odc_balanced_ms"] / 1e3 - base) / slope)
    hw = hw.with_(fixed_per_group=fixed)

    rows = []
    for system, key in (("fsdp2", "fsdp"), ("odc", "odc")):
        for workload in ("balanced", "imbalanced"):
            pred = simulate(plans[workload], lengths, model, hw, system)
            rows.append((f"{key}_{workload}", pred.step_s * 1e3, measured[f"{key}_{workload}_ms"]))
    lim = simulate(plans["imbalanced"], lengths, model, hw, "odc").limit_s * 1e3
    rows.append(("limit_imbalanced", lim, measured["limit_imbalanced_ms"]))

    print(f"Validation against the 2-rank CPU engine benchmark (measured: {source})")
    print(
        f"calibrated: compute {flops / 1e9:.2f} GFLOP/s from limit_balanced ({measured['limit_balanced_ms']:.1f} ms, "
        f"{flop / 1e9:.2f} GFLOP per rank-step); gloo all-gather {ag_bw / 1e6:.0f} MB/s + {ag_lat * 1e6:.0f} us, "
        f"reduce-scatter {rs_bw / 1e6:.0f} MB/s + {rs_lat * 1e6:.0f} us (live micro-benchmark, sizes {sizes} B; "
        f"simulator uses {hw.intra_bw / 1e6:.0f} MB/s + {hw.intra_lat * 1e6:.0f} us); shm read/acc {README_SHM} "
        f"(README transport table); hook overhead {fixed * 1e3:.2f} ms per group and pass, fitted on odc_balanced"
    )
    print(f"{'arm':20s} {'predicted ms':>13s} {'measured ms':>12s} {'error %':>8s}")
    out = {}
    for name, pred, meas in rows:
        err = 100 * (pred - meas) / meas
        fitted = " (fitted)" if name == "odc_balanced" else ""
        print(f"{name:20s} {pred:13.1f} {meas:12.1f} {err:8.1f}{fitted}")
        out[name] = {"predicted_ms": round(pred, 1), "measured_ms": meas, "error_pct": round(err, 2)}
    worst = max(abs(v["error_pct"]) for k, v in out.items() if k != "odc_balanced")
    print(f"largest |error| over predicted arms: {worst:.1f}% (target <= 15%)")
    return {"rows": out, "gloo": gloo, "flops": flops, "fixed_per_group_s": fixed, "max_abs_error_pct": worst}


def _use_runs_allocator(result: dict) -> None:
    """Measure communication live under the memory allocator the benchmark's runs used (the spawned measuring
    processes read glibc's variables at start; allocation is a large part of a microbatch's copies on CPU)."""
    import os

    from ..bench.e2e import CACHING_MALLOC, allocator_env

    for key in CACHING_MALLOC:
        os.environ.pop(key, None)
    os.environ.update(allocator_env(result.get("conditions", {}).get("allocator", "system")))


def run_validate_e2e(args: argparse.Namespace) -> dict:
    from .calibrate import measure_gloo, measure_microbatch_comm
    from .e2e import load_result, validate_e2e

    result = load_result(args.e2e_json)
    _use_runs_allocator(result)
    if args.model_config:
        with open(args.model_config) as f:
            config: Any = json.load(f)
    else:
        from ..data import tiny_qwen2_config

        config = tiny_qwen2_config().to_dict()  # what the examples build offline
    model = ModelSpec.from_config(config, param_bytes=args.param_bytes, grad_bytes=args.param_bytes)
    _, _, params = model.group_costs()
    sizes = sorted({int(p * args.param_bytes) for p in params} | {2**18, 2**23})
    gloo = measure_gloo(sizes, repeats=args.repeats)
    comm = measure_microbatch_comm(config)
    res = validate_e2e(result, model, gloo, README_SHM, comm)
    c = result["config"]
    print(
        f"Validation against the end-to-end benchmark ({args.e2e_json}: {c['workload']}, {c['world_size']} ranks, "
        f"{c['repeats']} repeats, {c['max_steps']} steps of which {c['warmup']} dropped)"
    )
    print(
        f"calibrated: compute {res['flops'] / 1e9:.2f} GFLOP/s from the limit arm; gloo all-gather "
        f"{gloo['ag_fit'][1] / 1e6:.0f} MB/s + {gloo['ag_fit'][0] * 1e6:.0f} us, reduce-scatter "
        f"{gloo['rs_fit'][1] / 1e6:.0f} MB/s + {gloo['rs_fit'][0] * 1e6:.0f} us (live, sizes {sizes} B); "
        f"shm {README_SHM} (README transport table); one microbatch's communication, measured live: FSDP2 "
        f"{comm['fsdp2_comm'] * 1e3:.1f} ms, ODC {comm['odc_comm'] * 1e3:.1f} ms (-> per group and pass "
        f"{res['fixed_per_group_s']['fsdp2'] * 1e3:.2f} / {res['fixed_per_group_s']['odc'] * 1e3:.2f} ms beyond the "
        "bandwidth figures); nothing fitted on the predicted arms"
    )
    print(
        f"{'arm':18s} {'pred step s':>11s} {'meas step s':>11s} {'error %':>8s} {'pred tok/s':>10s} {'meas tok/s':>10s}"
    )
    for name, r in res["rows"].items():
        print(
            f"{name:18s} {r['predicted_s']:11.3f} {r['measured_s']:11.3f} {r['error_pct']:8.1f} "
            f"{r['predicted_tokens_per_s']:10.1f} {r['measured_tokens_per_s']:10.1f}"
        )
    for name, v in res["speedups"].items():
        print(f"{name:28s} predicted {v['predicted']:.3f}x  measured {v['measured']:.3f}x")
    print(f"largest |error| over predicted arms: {res['max_abs_error_pct']:.1f}% (target <= 15%)")
    res["gloo"], res["comm"] = gloo, comm
    return res


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv and argv[0] in ("scale", "validate", "validate-e2e") else "scale"
    p = argparse.ArgumentParser(prog=f"python -m odc_accelerate.sim {cmd}", description=__doc__.split("\n")[0])
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
        p.add_argument("--json", action="store_true", help="print the results as JSON at the end")
        args = p.parse_args(argv)
        res = run_scale(args)
    elif cmd == "validate-e2e":
        p.add_argument(
            "--e2e-json",
            default="bench_e2e_sft",
            help="results.json (or its folder) of `python -m odc_accelerate.bench sft`",
        )
        p.add_argument("--model-config", default=None, help="config.json of the benchmarked model (default: offline)")
        p.add_argument("--param-bytes", type=int, default=4, help="bytes per parameter (4: the CPU configs' fp32)")
        p.add_argument("--repeats", type=int, default=20, help="repeats of each gloo collective")
        p.add_argument("--json", action="store_true")
        args = p.parse_args(argv)
        res = run_validate_e2e(args)
    else:
        p.add_argument("--engine-json", default=None, help="output of `python -m odc_accelerate.bench engine`")
        p.add_argument("--repeats", type=int, default=20, help="repeats of each gloo collective")
        p.add_argument("--json", action="store_true")
        args = p.parse_args(argv)
        res = run_validate(args)
    if args.json:
        print(json.dumps(res, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
