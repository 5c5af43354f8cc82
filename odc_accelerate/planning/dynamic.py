"""The ``"dynamic"`` plan: the step's microbatches in one queue, costliest first, claimed by ranks as they become free.

Every rank builds the same queue and a free rank claims the next microbatch (`odc_accelerate.transport.claims`), so a
cost model's error or a slower device is absorbed while the step runs. The queue keeps at least
``min(QUEUE_PER_RANK x ranks, samples)`` microbatches, splitting the costliest (`split_until`). As a `Plan` it is dealt
round-robin (rank ``r`` holds items ``r, r + W, ...``); `claim_queue` puts it back together. Why, and what was
measured: docs/planning.md, "The dynamic plan".
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .packing import Plan, pack_ffd

__all__ = ["QUEUE_PER_RANK", "claim_queue", "deal", "min_queue_length", "plan_dynamic", "queue_order", "split_until"]


QUEUE_PER_RANK = 4
"""The fewest microbatches per rank a step's queue is split into (see the module docstring)."""


def min_queue_length(samples: int, world: int) -> int:
    """The fewest microbatches a step's queue keeps: `QUEUE_PER_RANK` per rank, or one per sample when there are
    fewer."""
    return min(QUEUE_PER_RANK * world, samples)


def split_until(
    microbatches: list[list[int]],
    target: int,
    cost: Callable[[list[int]], float],
    halve: Callable[[list[int]], tuple[list[int], list[int]]],
) -> list[list[int]]:
    """Split the costliest microbatch of several samples in two (``halve``) until there are ``target`` microbatches or
    every microbatch holds one sample."""
    out = [list(mb) for mb in microbatches]
    while len(out) < target:
        splittable = [k for k, mb in enumerate(out) if len(mb) >= 2]
        if not splittable:
            break
        k = max(splittable, key=lambda j: (cost(out[j]), -min(out[j])))
        out[k : k + 1] = list(halve(out[k]))
    return out


def queue_order(microbatches: list[list[int]], costs: list[float]) -> list[list[int]]:
    """``microbatches`` costliest first (ties: the one with the smallest first index first)."""
    order = sorted(range(len(microbatches)), key=lambda k: (-costs[k], min(microbatches[k], default=-1)))
    return [microbatches[k] for k in order]


def deal(queue: list[list[int]], world: int) -> Plan:
    """The queue as a `Plan`: rank ``r`` holds items ``r, r + world, ...`` (inverse of `claim_queue`)."""
    return [queue[r::world] for r in range(world)]


def claim_queue(plan: Plan) -> list[list[int]]:
    """The step's queue of microbatches from a dealt `Plan` (`plan_step(..., plan="dynamic")`), in claim order."""
    world = len(plan)
    counts = [len(rank) for rank in plan]
    total = sum(counts)
    if counts != [len(range(r, total, world)) for r in range(world)]:
        raise ValueError(
            f"not a dealt queue (microbatches per rank {counts}): claim_queue takes a plan made with plan='dynamic'"
        )
    return [plan[k % world][k // world] for k in range(total)]


def plan_dynamic(costs: np.ndarray, tokens: np.ndarray, world: int, budget: int) -> Plan:
    """Pack the whole step into as few microbatches as the token budget allows (first-fit decreasing on tokens), split
    the costliest until there are `min_queue_length` of them, order them costliest first and deal them (see the module
    docstring).

    Args:
        costs (`np.ndarray`): float64 cost of each sample.
        tokens (`np.ndarray`): int64 token count of each sample.
        world (`int`): number of ranks.
        budget (`int`): token budget of one microbatch.
    """

    def cost(mb: list[int]) -> float:
        return float(costs[mb].sum())

    def halve(mb: list[int]) -> tuple[list[int], list[int]]:
        # LPT into two halves, costliest sample first (ties: more tokens, then the lower index)
        halves: tuple[list[int], list[int]] = ([], [])
        loads = [0.0, 0.0]
        for i in sorted(mb, key=lambda i: (-costs[i], -tokens[i], i)):
            h = 0 if loads[0] <= loads[1] else 1
            halves[h].append(i)
            loads[h] += float(costs[i])
        if not halves[1]:  # samples of zero cost all tie with the empty half; each half must hold one
            halves[1].append(halves[0].pop())
        return halves

    microbatches = pack_ffd(np.arange(costs.size), tokens, budget)
    microbatches = split_until(microbatches, min_queue_length(costs.size, world), cost, halve)
    return deal(queue_order(microbatches, [cost(mb) for mb in microbatches]), world)
