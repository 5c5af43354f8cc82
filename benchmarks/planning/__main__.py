"""``python -m benchmarks.planning``: step planners against random sampling and BatchRebalanceSampler.

For several long-tailed length distributions and 2, 8 and 64 ranks, every arm plans the SAME steps (same samples
per optimizer step) and the benchmark reports, averaged over steps and relative to the mean per-rank cost:

- ``odc``: ``max_r C_r / mean_r C_r``, what a step costs with ODC (ranks never wait inside a step);
- ``lockstep``: ``sum_k max_r C_rk / mean_r C_r``, what a step costs with plain FSDP2 (every microbatch slot waits
  for its slowest rank);
- ``bound``: ``max(1, largest single-sample cost / mean_r C_r)``, which no plan beats on either metric.

Arms: ``random`` (shuffled step samples dealt to ranks, one sample per microbatch, as the Trainer does with
``per_device_train_batch_size=1``), transformers' ``BatchRebalanceSampler`` driven as the Trainer drives it
(``train_sampling_strategy="batch_rebalance"``) for two per-device batch sizes, a plain LPT greedy (``lpt``: the
per-rank totals, no refinement), and the planner's ``lockstep`` and ``free`` plans. Costs use the
planner's default model (the published 7B fit). The random and BatchRebalanceSampler arms know no token budget, so
the table also shows the share of their microbatches over it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import numpy as np

from odc_accelerate.planning import PUBLISHED_1_5B_COST, PUBLISHED_7B_COST, flops_cost, plan_from_costs
from odc_accelerate.planning.packing import desc_order, lpt

from .arms import brs_plans, lpt_plan, random_plan
from .distributions import distributions
from .metrics import step_metrics


def _metrics(plan, costs: np.ndarray, tokens: np.ndarray, budget: int) -> tuple[float, ...]:
    m = step_metrics(plan, costs)
    sizes = [(len(mb), int(tokens[mb].sum()) if mb else 0) for mbs in plan for mb in mbs]
    # A microbatch over the budget only counts when it holds several samples (a lone long sample cannot be split).
    over = sum(count > 1 and toks > budget for count, toks in sizes) / max(len(sizes), 1)
    return m["odc"], m["lockstep"], m["bound"], m["tight_bound"], m["microbatches"], over


def _cost_check() -> list[str]:
    # Qwen2.5 configs (hidden, intermediate, layers, heads, kv heads, vocab) against the published step-time fits.
    lines = []
    for name, (h, inter, layers, heads, kv, vocab), fit in (
        ("Qwen2.5-7B", (3584, 18944, 28, 28, 4, 152064), PUBLISHED_7B_COST),
        ("Qwen2.5-1.5B", (1536, 8960, 28, 12, 2, 151936), PUBLISHED_1_5B_COST),
    ):
        model = flops_cost(layers, h, inter, heads, kv, vocab)
        lines.append(
            f"  {name:13s} flops_cost quadratic/linear = {model.quadratic_to_linear:.3e}/token, published fit "
            f"{fit.quadratic_to_linear:.3e}/token, ratio {model.quadratic_to_linear / fit.quadratic_to_linear:.3f}"
        )
    return lines


def _brute_force(instances: int, seed: int) -> dict[str, float]:
    """The free plan and plain LPT against the exhaustive optimum on small steps (n <= 9 samples, 2-3 ranks)."""
    rng = np.random.default_rng(seed)
    gaps, lpt_gaps = [], []
    for _ in range(instances):
        world = int(rng.integers(2, 4))
        n = int(rng.integers(2, 10 if world == 2 else 9))
        tokens = rng.integers(256, 65536, n)
        costs = PUBLISHED_7B_COST(tokens)
        assign = np.array(list(itertools.product(range(world), repeat=n)))
        best = np.stack([((assign == r) * costs).sum(axis=1) for r in range(world)], axis=1).max(axis=1).min()
        plan = plan_from_costs(costs, tokens, world, 65536, "free")
        gaps.append(max(costs[[i for mb in rank for i in mb]].sum() for rank in plan) / best - 1)
        lpt_rank = lpt(costs, desc_order(costs, tokens), world)
        lpt_gaps.append(np.bincount(lpt_rank, weights=costs, minlength=world).max() / best - 1)
    return {
        "instances": instances,
        "free_mean_gap_pct": 100 * float(np.mean(gaps)),
        "free_max_gap_pct": 100 * float(np.max(gaps)),
        "free_optimal_share": float(np.mean(np.array(gaps) < 1e-12)),
        "lpt_mean_gap_pct": 100 * float(np.mean(lpt_gaps)),
        "lpt_max_gap_pct": 100 * float(np.max(lpt_gaps)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planning", description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 8, 64])
    parser.add_argument("--dists", nargs="+", default=None, help="subset of: longalign swe-smith pydoc bimodal")
    parser.add_argument("--samples-per-rank", type=int, default=8, help="samples per optimizer step per rank")
    parser.add_argument("--steps", type=int, default=None, help="steps per (distribution, world); default by world")
    parser.add_argument("--timing-reps", type=int, default=30, help="planner timings at 512 sequences / 64 ranks")
    parser.add_argument("--brute-force", type=int, default=200, help="small instances solved exhaustively")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    dists = distributions()
    names = args.dists or list(dists)
    unknown = [d for d in names if d not in dists]
    if unknown:
        parser.error(f"unknown distribution(s) {unknown}; choose from {list(dists)}")
    cost_fn = PUBLISHED_7B_COST
    arms = ["random bs1", "brs bs1", "brs bs2", "lpt greedy", "plan lockstep", "plan free"]

    print("Step planning benchmark: per-step ratios to the mean per-rank cost, averaged over steps.")
    print(
        f"cost model: published 7B fit 4.348 x^2 + 8.768 x, x = L/32000; {args.samples_per_rank} samples per rank "
        "per step, the same samples for every arm"
    )
    print("cost check (model-derived, causal attention, fwd+bwd):")
    print("\n".join(_cost_check()))
    print("distributions:")
    for name in names:
        print(f"  {name:10s} {dists[name][0]}; budget {dists[name][1]} tokens/microbatch")
    print(
        "arms: random bs1 = shuffled samples, 1 per microbatch (Trainer default sampler, per_device_train_batch_size=1)"
    )
    print("      brs bsN = transformers BatchRebalanceSampler as the Trainer builds it, per_device_train_batch_size=N")
    print("      lpt greedy = per-rank LPT + first-fit packing (no refinement); plan = the step planner")
    print("columns: odc = max_r C_r / mean_r C_r; lockstep = sum_k max_r C_rk / mean_r C_r;")
    print("  bound = max(1, largest sample / mean_r C_r); tight = metrics.lower_bound / mean_r C_r (>= bound);")
    print("  gap % / gapT % = mean over steps of odc / bound - 1 and odc / tight - 1; mbs = microbatches on the")
    print("  busiest rank; over = multi-sample microbatches over the token budget; ms = median planning time per step")
    print()
    header = (
        f"{'dist':10s} {'W':>3s} {'arm':14s} {'odc':>7s} {'lockstep':>8s} {'bound':>7s} {'tight':>7s} "
        f"{'gap %':>6s} {'gapT %':>6s} {'mbs':>5s} {'over':>6s} {'ms':>7s}"
    )
    print(header)
    print("-" * len(header))

    results: dict = {}
    plan_ms: dict[str, dict[str, float]] = {}
    rng = np.random.default_rng(args.seed)
    for name in names:
        _, budget, draw = dists[name]
        results[name] = {}
        for world in args.worlds:
            steps = args.steps or {2: 200, 8: 100}.get(world, 20)
            spr = args.samples_per_rank * world
            lengths = draw(rng, steps * spr)
            costs_all = cost_fn(lengths)
            figures: dict[str, list] = {arm: [] for arm in arms}
            times: dict[str, list] = {arm: [] for arm in arms}
            brs = {}
            for per_device in (1, 2):
                if spr % (world * per_device) == 0:
                    brs[per_device], t = brs_plans(lengths, world, per_device, spr)
                    times[f"brs bs{per_device}"] = [t]
            for s in range(steps):
                sl = slice(s * spr, (s + 1) * spr)
                tok, cst = lengths[sl], costs_all[sl]
                plans = {"random bs1": random_plan(spr, world, 1)}
                for per_device, step_plans in brs.items():
                    plans[f"brs bs{per_device}"] = step_plans[s]
                plans["lpt greedy"] = lpt_plan(cst, tok, world, budget)
                # Interleave the two plans so machine noise hits both alike.
                for arm, plan_name in (("plan lockstep", "lockstep"), ("plan free", "free")):
                    t0 = time.perf_counter()
                    plans[arm] = plan_from_costs(cst, tok, world, budget, plan_name)
                    times[arm].append(time.perf_counter() - t0)
                for arm, plan in plans.items():
                    figures[arm].append(_metrics(plan, cst, tok, budget))
            results[name][world] = {}
            for arm in arms:
                if not figures[arm]:
                    continue
                odc, lock, bound, tight, mbs, over = (float(np.mean(col)) for col in zip(*figures[arm], strict=True))
                gap = 100.0 * float(np.mean([f[0] / f[2] - 1.0 for f in figures[arm]]))
                gap_t = 100.0 * float(np.mean([f[0] / f[3] - 1.0 for f in figures[arm]]))
                ms = 1000 * statistics.median(times[arm]) if times[arm] else float("nan")
                results[name][world][arm] = {
                    "odc": round(odc, 4),
                    "lockstep": round(lock, 4),
                    "bound": round(bound, 4),
                    "gap_pct": round(gap, 3),
                    "tight_gap_pct": round(gap_t, 3),
                }
                print(
                    f"{name:10s} {world:3d} {arm:14s} {odc:7.4f} {lock:8.4f} {bound:7.4f} {tight:7.4f} {gap:6.2f} "
                    f"{gap_t:6.2f} {mbs:5.2f} {100 * over:5.1f}% {ms:7.2f}"
                )
            print()

        # Planning time at 512 sequences over 64 ranks, plans interleaved, on this distribution.
        sample = draw(rng, 512)
        cst = cost_fn(sample)
        # Wall time is what a step waits for; CPU time (process_time) shows how much of it contention on a shared
        # machine adds.
        wall: dict[str, list[float]] = {"free": [], "lockstep": []}
        cpu: dict[str, list[float]] = {"free": [], "lockstep": []}
        for _ in range(args.timing_reps):
            for plan_name in ("free", "lockstep"):
                t0, c0 = time.perf_counter(), time.process_time()
                plan_from_costs(cst, sample, 64, budget, plan_name)
                wall[plan_name].append(1000 * (time.perf_counter() - t0))
                cpu[plan_name].append(1000 * (time.process_time() - c0))
        plan_ms[name] = {plan_name: round(statistics.median(v), 2) for plan_name, v in wall.items()}
        plan_ms[name] |= {f"{plan_name}_cpu": round(statistics.median(v), 2) for plan_name, v in cpu.items()}

    print(f"plan time, 512 sequences / 64 ranks (median of {args.timing_reps} interleaved runs; target <= 50 ms):")
    for name, t in plan_ms.items():
        print(
            f"  {name:10s} free {t['free']:6.2f} ms wall ({t['free_cpu']:6.2f} cpu)   "
            f"lockstep {t['lockstep']:6.2f} ms wall ({t['lockstep_cpu']:6.2f} cpu)"
        )

    summary: dict = {
        "bench": "planning",
        "samples_per_rank": args.samples_per_rank,
        "cost": "published 7B fit",
        "plan_ms_512x64": plan_ms,
    }
    if args.brute_force:
        bf = _brute_force(args.brute_force, args.seed)
        print(
            f"vs exhaustive optimum ({bf['instances']} steps of 2-9 samples on 2-3 ranks): plan free mean gap "
            f"{bf['free_mean_gap_pct']:.3f}% (max {bf['free_max_gap_pct']:.2f}%, optimal in "
            f"{100 * bf['free_optimal_share']:.0f}%), plain LPT mean gap {bf['lpt_mean_gap_pct']:.3f}% "
            f"(max {bf['lpt_max_gap_pct']:.2f}%)"
        )
        summary["brute_force"] = {k: round(v, 4) for k, v in bf.items()}
    if 8 in args.worlds:
        w8 = {n: results[n][8] for n in names}
        summary["w8_free_gap_to_bound_pct"] = {n: w8[n]["plan free"]["gap_pct"] for n in names}
        summary["w8_free_gap_to_tight_bound_pct"] = {n: w8[n]["plan free"]["tight_gap_pct"] for n in names}
        summary["w8_free_gap_to_tight_bound_pct_mean"] = round(
            float(np.mean([w8[n]["plan free"]["tight_gap_pct"] for n in names])), 3
        )
        summary["w8_lpt_gap_to_tight_bound_pct"] = {n: w8[n]["lpt greedy"]["tight_gap_pct"] for n in names}
        print(
            "Free plan at 8 ranks, mean gap to the lower bound: "
            + ", ".join(
                f"{n} {w8[n]['plan free']['gap_pct']:.2f}% (tight {w8[n]['plan free']['tight_gap_pct']:.2f}%)"
                for n in names
            )
        )
    summary["lockstep_ratio"] = {
        n: {
            str(w): {arm: v["lockstep"] for arm, v in results[n][w].items() if arm != "lpt greedy"}
            for w in args.worlds
        }
        for n in names
    }
    print()
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
