"""``python -m benchmarks.sim scale``: predicted step times at scale, four arms on the same steps.

For each model (Qwen2.5-1.5B / 7B configs) and world size (8, 64, 256, 1024 GPUs, 8 per node, H100-like figures,
assumed), plans the SAME steps of long-tailed lengths (LongAlign-like by default, or ``--lengths-file``) with four
arms and simulates them: FSDP2 + random sampling (Trainer default, one sample per microbatch), FSDP2 + transformers'
BatchRebalanceSampler, FSDP2 + this package's ``lockstep`` plan, ODC + this package's ``free`` plan.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np

from benchmarks.sim.simulator import H100, QWEN2_5_1_5B, QWEN2_5_7B, ModelSpec, simulate
from odc_accelerate.planning import QuadraticCost, flops_cost, plan_from_costs

MODELS = {"1.5b": QWEN2_5_1_5B, "7b": QWEN2_5_7B}
ARMS = ("FSDP2 + random", "FSDP2 + batch_rebalance", "FSDP2 + plan lockstep", "ODC + plan free")
PAPER_SFT_MAX_SPEEDUP = 1.36  # "Revisiting Parameter Server in LLM Post-Training": up to 36% faster SFT than FSDP


def planner_cost(model: ModelSpec) -> QuadraticCost:
    """The planner's cost of a sample: the FLOP model the simulator charges (what ``cost="auto"`` derives from a
    config), or the measured seconds of a calibration (only its ratios matter to the planner)."""
    if model.seconds is not None:
        return model.seconds
    return flops_cost(
        model.layers, model.hidden, model.intermediate, model.heads, model.kv_heads, model.vocab, model.head_dim,
        model.gated_mlp,
    )  # fmt: skip


def compute_sources(names: list[str], calibration: str | None, tflops: float) -> tuple[dict[str, ModelSpec], dict]:
    """Each model's `ModelSpec` and where its compute time comes from: a calibration file's measured seconds when
    ``calibration`` names one that has the model (``qwen2.5-<name>``), else the FLOP count at ``tflops`` (assumed).

    Raises:
        FileNotFoundError / `benchmarks.calibration.CalibrationError`: an unusable file, or a file whose model
            shape differs from the simulator's.
    """
    models, sources = {name: MODELS[name] for name in names}, {}
    assumed = f"FLOP count at {tflops:.0f} TFLOP/s per GPU (assumed)"
    if calibration is None:
        return models, {name: assumed for name in names}
    from benchmarks.calibration import CalibrationError, calibrated_models, load_calibration

    available = calibrated_models(calibration)
    for name in names:
        key = f"qwen2.5-{name}"
        if key not in available:
            sources[name] = f"{assumed}: {calibration} has no {key}"
            continue
        cal = load_calibration(calibration, key)
        measured = ModelSpec.from_config(cal.config)
        if measured != replace(models[name], param_bytes=measured.param_bytes, grad_bytes=measured.grad_bytes):
            raise CalibrationError(
                f"{calibration}: the shape of {key} ({measured}) is not the simulator's ({MODELS[name]})."
            )
        models[name] = replace(models[name], seconds=cal.cost, fixed_s=cal.intercept_s)
        sources[name] = cal.describe()
    return models, sources


def _random_plan(n: int, world: int) -> list[list[list[int]]]:
    # Shuffled samples, one per microbatch; consecutive samples go to ranks 0..W-1 in turn (accelerate's sharding).
    return [[[k * world + r] for k in range(n // world)] for r in range(world)]


def arm_plans(lengths: np.ndarray, world: int, samples_per_step: int, budget: int, model: ModelSpec) -> dict:
    """Every arm's plan for every step of ``lengths`` (consecutive chunks of ``samples_per_step``)."""
    from odc_accelerate._compat.transformers import batch_rebalance_global_plans  # transformers: imported on use

    steps = lengths.size // samples_per_step
    cost = planner_cost(model)
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
        out["FSDP2 + plan lockstep"].append(plan_from_costs(costs, tok, world, budget, plan="lockstep"))
        out["ODC + plan free"].append(plan_from_costs(costs, tok, world, budget, plan="free"))
    return out


def _draw_lengths(args: argparse.Namespace, rng: np.random.Generator, n: int) -> tuple[np.ndarray, str, int]:
    if args.lengths_file:
        path = args.lengths_file
        pool = np.load(path) if path.endswith(".npy") else np.loadtxt(path, dtype=np.int64)
        pool = np.asarray(pool, dtype=np.int64).ravel()
        return rng.choice(pool, n), f"{path} ({pool.size} lengths, drawn with replacement)", int(pool.max())
    from benchmarks.planning.distributions import distributions

    desc, budget, draw = distributions()[args.dist]
    return draw(rng, n), desc, budget


def run_scale(args: argparse.Namespace) -> dict:
    """Plan the same steps with every arm, simulate them per model and world size, print the table."""
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
    models, sources = compute_sources(args.models, getattr(args, "calibration", None), hw.flops / 1e12)
    print(
        f"Simulated step times: {hw.flops / 1e12:.0f} TFLOP/s effective per GPU, {hw.gpus_per_node} GPUs/node, "
        f"intra {hw.intra_bw / 1e9:.0f} GB/s ({hw.intra_lat * 1e6:.0f} us/hop), inter {hw.inter_bw / 1e9:.0f} GB/s "
        f"({hw.inter_lat * 1e6:.0f} us/hop), overlap={hw.overlap}, contention={hw.contention}, bf16 params, fp32 "
        f"grad reduce; {args.samples_per_rank} samples per rank per step"
    )
    for name in args.models:
        print(f"compute, {name}: {sources[name]}")
    header = (
        f"{'model':6s} {'GPUs':>5s} {'arm':24s} {'step s':>8s} {'Mtok/s':>8s} {'bubble%':>8s} {'vs rand':>8s} "
        f"{'vs BRS':>7s} {'vs lock':>7s} {'/limit':>7s}"
    )
    results: dict = {}
    printed_dist = False
    for name in args.models:
        model = models[name]
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
    best = max(results[m][w]["ODC + plan free"]["speedup_vs_random"] for m in results for w in results[m])
    best_brs = max(results[m][w]["ODC + plan free"]["speedup_vs_brs"] for m in results for w in results[m])
    lock = [results[m][w]["ODC + plan free"]["speedup_vs_lockstep"] for m in results for w in results[m]]
    print(
        f"ODC + plan vs FSDP2 + random: up to {best:.2f}x; vs FSDP2 + batch_rebalance: up to {best_brs:.2f}x; vs "
        f"FSDP2 + lockstep plan (same balancing effort): {min(lock):.2f}x-{max(lock):.2f}x "
        f"(paper, SFT: up to {PAPER_SFT_MAX_SPEEDUP:.2f}x over FSDP)"
    )
    results["compute_source"] = sources
    return results
