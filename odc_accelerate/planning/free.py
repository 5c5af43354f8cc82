"""The ``"free"`` plan: balanced per-rank totals, any number of microbatches per rank.

With On-Demand Communication ranks never wait for each other inside a step, so a step costs ``max_r C_r`` where
``C_r`` is the total work of rank r (LB-Mini in the ODC paper, "Revisiting Parameter Server in LLM Post-Training").
"""

from __future__ import annotations

import numpy as np

from .packing import Plan, desc_order, lpt, pack_ffd, refine_totals

__all__ = ["plan_free"]


def plan_free(costs: np.ndarray, tokens: np.ndarray, world: int, budget: int) -> Plan:
    """Minimise the largest per-rank total cost, then cut each rank's samples into as few microbatches as fit.

    Ranks are balanced by LPT greedy, then by moves and swaps out of the most loaded rank until none helps
    (`refine_totals`); each rank's samples are then packed first-fit decreasing on tokens (`pack_ffd`). A rank gets
    no microbatch at all only when there are fewer samples than ranks.

    Args:
        costs (`np.ndarray`): float64 cost of each sample.
        tokens (`np.ndarray`): int64 token count of each sample.
        world (`int`): number of ranks.
        budget (`int`): token budget of one microbatch.
    """
    order = desc_order(costs, tokens)
    rank_of = lpt(costs, order, world)
    if world > 1:
        rank_of = refine_totals(costs, rank_of, world)
    plan: Plan = []
    for r in range(world):
        members = np.flatnonzero(rank_of == r)
        plan.append(pack_ffd(members, tokens, budget))
    return plan
