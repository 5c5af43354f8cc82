"""Figures of a step plan that only the benchmark and the tests need: a lower bound and imbalance ratios."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from odc_accelerate.planning import Plan

__all__ = ["lower_bound", "step_metrics"]


def lower_bound(costs: Sequence[float] | np.ndarray, world_size: int) -> float:
    """A lower bound on ``max_r C_r`` of any assignment of ``costs`` to ``world_size`` ranks (absolute cost units).

    The largest of:

    - the mean per-rank cost;
    - pigeonhole: for every m, one rank holds at least ``ceil(m / world_size)`` of the m costliest samples, so at
      least the sum of the cheapest that many of them (m = 1 gives the largest single sample);
    - pairing: for ``m = world_size + j`` with ``1 <= j <= world_size``, either some rank holds three of the m
      costliest samples (so at least the three cheapest of them), or exactly j ranks hold two each; the pairs
      then cost at least as much as the 2j cheapest of the m paired largest-with-smallest (the min-max pairing),
      so the smaller of the two figures bounds the step from below.

    Args:
        costs (`Sequence[float]` or `np.ndarray`): cost of every sample.
        world_size (`int`): number of ranks.
    """
    c = np.sort(np.asarray(costs, dtype=np.float64))[::-1]
    n = c.size
    if n == 0:
        return 0.0
    prefix = np.concatenate(([0.0], np.cumsum(c)))
    m = np.arange(1, n + 1)
    q = -(-m // world_size)
    best = max(prefix[-1] / world_size, float((prefix[m] - prefix[m - q]).max()))
    for j in range(1, min(world_size, n - world_size) + 1):
        top = world_size + j
        group = c[top - 2 * j : top]  # the 2j cheapest of the `top` costliest
        pairs = float((group + group[::-1]).max())
        triple = float(c[top - 3 : top].sum()) if top >= 3 else math.inf
        best = max(best, min(pairs, triple))
    return best


def step_metrics(plan: Plan, costs: Sequence[float] | np.ndarray) -> dict[str, float]:
    """Imbalance figures of one step plan, each relative to the mean per-rank cost.

    Returns a dict with ``odc`` (``max_r C_r / mean_r C_r``: what an ODC step pays), ``lockstep``
    (``sum_k max_r C_rk / mean_r C_r``: what a lockstep step pays; ranks with fewer microbatches count as empty
    in the missing slots), ``bound`` (``max(1, largest sample cost / mean_r C_r)``: no plan does better on either
    metric), ``tight_bound`` (`lower_bound` of the plan's samples relative to the mean, >= ``bound``) and
    ``microbatches`` (largest number of microbatches on one rank).

    Args:
        plan (`list[list[list[int]]]`): a plan as returned by `odc_accelerate.planning.plan_step`.
        costs (`Sequence[float]` or `np.ndarray`): cost of each index used in the plan.
    """
    costs = np.asarray(costs, dtype=np.float64)
    world = len(plan)
    slots = max((len(p) for p in plan), default=0)
    per = np.zeros((world, max(slots, 1)))
    for r, mbs in enumerate(plan):
        for k, mb in enumerate(mbs):
            per[r, k] = costs[mb].sum() if len(mb) else 0.0
    totals = per.sum(axis=1)
    mean = totals.mean()
    if mean <= 0:
        return {"odc": 1.0, "lockstep": 1.0, "bound": 1.0, "tight_bound": 1.0, "microbatches": float(slots)}
    used = np.concatenate([np.asarray(mb, dtype=np.int64) for mbs in plan for mb in mbs] or [np.zeros(0, np.int64)])
    biggest = costs[used].max() if used.size else 0.0
    return {
        "odc": float(totals.max() / mean),
        "lockstep": float(per.max(axis=0).sum() / mean),
        "bound": float(max(1.0, biggest / mean)),
        "tight_bound": float(lower_bound(costs[used], world) / mean),
        "microbatches": float(slots),
    }
