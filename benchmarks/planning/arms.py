"""Arms of the planning benchmark: each maps one step's samples to a plan (``plan[r][k]`` = indices into the step).

The planner's own arms (`odc_accelerate.planning.plan_from_costs`) are called directly by the benchmark.
"""

from __future__ import annotations

import time

import numpy as np

from odc_accelerate.planning.packing import Plan, desc_order, lpt, pack_ffd

__all__ = ["brs_plans", "check_brs_capture", "lpt_plan", "random_plan"]


def random_plan(n: int, world: int, per_device: int) -> Plan:
    """The Trainer's default sampler on ``n`` already shuffled samples, ``per_device`` samples per microbatch."""
    # Like accelerate's batch sharding: consecutive per-device batches go to ranks 0..W-1 in turn, so rank r's k-th
    # microbatch is batch k * W + r.
    slots = n // (world * per_device)
    return [
        [list(range((k * world + r) * per_device, (k * world + r + 1) * per_device)) for k in range(slots)]
        for r in range(world)
    ]


def brs_plans(lengths: np.ndarray, world: int, per_device: int, samples_per_step: int) -> tuple[list, float]:
    """Plans of transformers' BatchRebalanceSampler for consecutive steps of ``lengths``, as the Trainer builds it."""
    from odc_accelerate._compat.transformers import batch_rebalance_global_plans

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


def check_brs_capture(lengths: np.ndarray, world: int, per_device: int, samples_per_step: int) -> None:
    """Sanity check: the captured plan equals what each rank's own sampler yields (catches a transformers change)."""
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    grad_accum = samples_per_step // (world * per_device)
    captured, _ = brs_plans(lengths, world, per_device, samples_per_step)
    for r in range(world):
        own = list(
            BatchRebalanceSampler(
                lengths.tolist(), per_device * grad_accum * world, world, grad_accum, shuffle=False, rank=r
            )
        )
        mine = [[i + s * samples_per_step for i in mb] for s, plan in enumerate(captured) for mb in plan[r]]
        if own != mine:
            raise RuntimeError("BatchRebalanceSampler internals changed: the benchmark's capture no longer matches.")


def lpt_plan(costs: np.ndarray, tokens: np.ndarray, world: int, budget: int) -> Plan:
    """Plain LPT greedy on the per-rank totals (no refinement), each rank packed first-fit decreasing on tokens."""
    rank_of = lpt(costs, desc_order(costs, tokens), world)
    return [pack_ffd(np.flatnonzero(rank_of == r), tokens, budget) for r in range(world)]
