"""How much of a padded-pair run's bubble any plan could remove: the measured compute of padded microbatches, fitted,
and per step the best split of its pairs over the ranks under that fit.

``python -m benchmarks.e2e.pair_bound benchmarks/e2e/dpo/results.json [--arm odc]``

From the planned arm's step traces (each rank's microbatches as ``rows x width`` and its busy seconds per step) it
fits ``busy = d + a * sum(rows * width) + b * sum(rows * width^2)`` over every (repeat, rank, step) by least squares,
then, per step, tries every assignment of the step's pairs to the ranks (each rank's pairs packed into microbatches
under the run's token budget, each microbatch padded to its widest pair) and reports the plan's bubble and the
imbalance of the assignment that ends the step soonest, both under the fitted cost. When the two agree, the bubble is the step's
granularity (too few pairs, or pairs too wide, to split evenly), which no cost model removes; more pairs per step do.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
from pathlib import Path

import numpy as np

from benchmarks.calibration.fit import nonnegative_lstsq


def pair_widths(microbatch: dict) -> list[int]:
    """The pairs of one traced microbatch as their own widths: rows ``i`` and ``i + n`` are a pair's chosen and
    rejected sequences (TRL concatenates every chosen row, then every rejected one), a pair's width the longer."""
    tokens, n = microbatch["row_tokens"], microbatch["rows"] // 2
    return [max(tokens[i], tokens[i + n]) for i in range(n)]


def features(microbatches: list[tuple[int, int]]) -> np.ndarray:
    """The fitted terms of one rank's step: ``[1, sum(rows * width), sum(rows * width^2)]``."""
    return np.array([1.0, sum(r * w for r, w in microbatches), sum(r * w * w for r, w in microbatches)])


def fit(samples: list[tuple[list[tuple[int, int]], float]]) -> np.ndarray:
    """Least squares on relative error of ``busy`` over ``(microbatches, busy_s)`` samples, every coefficient >= 0
    (each is a cost: the best fit over the subsets of terms whose coefficients are all non-negative); returns
    ``[d, a, b]``."""
    x = np.stack([features(mbs) for mbs, _ in samples])
    y = np.array([busy for _, busy in samples])
    scale = x.max(axis=0)
    best = nonnegative_lstsq(x / scale / y[:, None], np.ones_like(y))
    assert best is not None  # a single positive term always fits positive times
    return best[1] / scale


def _partitions(items: list[int]):
    """Every set partition of ``items`` (as lists of blocks)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _partitions(rest):
        for i in range(len(partition)):
            yield partition[:i] + [[first, *partition[i]]] + partition[i + 1 :]
        yield [[first], *partition]


@functools.cache
def _best_packing(widths: tuple[int, ...], budget: int, coef: tuple[float, ...]) -> float:
    best = float("inf")
    for partition in _partitions(list(widths)):
        mbs = [(2 * len(block), max(block)) for block in partition]
        if any(rows > 2 and rows * width > budget for rows, width in mbs):
            continue  # a lone pair wider than the budget still runs on its own, as the planner allows
        best = min(best, float(features(mbs) @ np.asarray(coef)))
    return best


def best_packing(widths: list[int], budget: int, coef: np.ndarray) -> float:
    """The cheapest packing of one rank's pairs into microbatches of at most ``budget`` padded tokens (2 rows per
    pair, padded to the widest), under the fitted cost."""
    return _best_packing(tuple(sorted(widths)), budget, tuple(float(c) for c in coef)) if widths else 0.0


def imbalance(costs: list[float]) -> float:
    """``1 - mean / max`` of the ranks' compute: the share of the step the ranks spend waiting, on average."""
    return 1.0 - statistics.fmean(costs) / max(costs)


def best_split(widths: list[int], world: int, budget: int, coef: np.ndarray) -> list[float]:
    """The ranks' fitted compute under the assignment of the step's pairs that ends the step soonest (the least
    slowest rank; of those, the least imbalance), each rank packing its pairs as cheaply as it can."""
    best: tuple[float, float, list[float]] | None = None
    for owners in itertools.product(range(world), repeat=len(widths)):
        costs = [
            best_packing([w for w, o in zip(widths, owners, strict=True) if o == r], budget, coef)
            for r in range(world)
        ]
        key = (max(costs), imbalance(costs))
        if best is None or key < best[:2]:
            best = (*key, costs)
    assert best is not None
    return best[2]


def analyse(results: dict, arm: str) -> dict:
    """The fit and the per-step bubbles (plan, best, measured) of ``arm`` in an e2e ``results.json``."""
    config = results["config"]
    budget = 2 * int(config["max_length"])  # the planned arms' token budget: a pair of max_length rows
    warmup = int(config.get("warmup", 1))
    samples, steps = [], []
    for run in results["runs"][arm]:
        for ranks in run["trace"]:  # one entry per process; each holds every rank's steps
            for index in range(warmup, min(len(r) for r in ranks)):
                per_rank = [r[index] for r in ranks]
                shapes = [[(m["rows"], m["width"]) for m in s["microbatches"]] for s in per_rank]
                samples += [(mbs, s["busy_s"]) for mbs, s in zip(shapes, per_rank, strict=True) if mbs]
                widths = [w for s in per_rank for m in s["microbatches"] for w in pair_widths(m)]
                steps.append((run["repeat"], index + 1, shapes, widths, [s["busy_s"] for s in per_rank]))
    coef = fit(samples)
    errors = [float(features(mbs) @ coef) / busy - 1 for mbs, busy in samples]
    rows = []
    for repeat, step, shapes, widths, busy in steps:
        planned = [float(features(mbs) @ coef) for mbs in shapes]
        best = best_split(widths, len(shapes), budget, coef)
        rows.append(
            dict(
                repeat=repeat,
                step=step,
                widths=sorted(widths, reverse=True),
                measured=imbalance(busy),
                plan=imbalance(planned),
                best=imbalance(best),
                plan_over_best=max(planned) / max(best),
            )
        )
    return dict(coef=coef.tolist(), fit_errors=errors, steps=rows)


def report(result: dict) -> str:
    d, a, b = result["coef"]
    col = max(len("pair widths"), *(len(str(r["widths"])) for r in result["steps"]))
    errors = np.abs(result["fit_errors"])
    lines = [
        f"busy_s = {d:.3f} + {a * 1e3:.4f} ms x sum(rows x width) + {b * 1e6:.4f} us x sum(rows x width^2) "
        f"over {errors.size} rank-steps: median |error| {np.median(errors):.1%}, max {errors.max():.1%}",
        "imbalance = 1 - mean / max of the ranks' compute: measured (busy s), and under the fitted cost for the plan "
        "that ran and for the best assignment of the step's pairs; plan / best: the slowest rank's fitted compute",
        f"{'repeat':>6s} {'step':>4s}  {'pair widths':{col}s} {'measured':>9s} {'plan':>7s} {'best':>7s} {'plan/best':>9s}",
    ]
    for r in result["steps"]:
        lines.append(
            f"{r['repeat']:6d} {r['step']:4d}  {str(r['widths']):{col}s} {r['measured']:9.1%} {r['plan']:7.1%} "
            f"{r['best']:7.1%} {r['plan_over_best']:9.3f}"
        )
    mean = {k: statistics.fmean(r[k] for r in result["steps"]) for k in ("measured", "plan", "best", "plan_over_best")}
    lines.append(
        f"{'mean':>11s}  {'':{col}s} {mean['measured']:9.1%} {mean['plan']:7.1%} {mean['best']:7.1%} "
        f"{mean['plan_over_best']:9.3f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e.pair_bound", description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="an e2e results.json of a padded-pair workload (dpo, reward)")
    p.add_argument("--arm", default="odc", help="the planned arm whose traces are read (default: odc)")
    args = p.parse_args(argv)
    print(report(analyse(json.loads(args.results.read_text()), args.arm)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
