"""Building blocks shared by the planners: sample order, LPT, first-fit packing, per-rank refinement, slot hand-out.

All work on numpy arrays of per-sample costs and token counts; a sample is its index into them.
"""

from __future__ import annotations

import heapq

import numpy as np

__all__ = ["Plan", "assign_slots_to_ranks", "desc_order", "lpt", "pack_ffd", "refine_totals"]

Plan = list[list[list[int]]]
"""A step plan: ``plan[r]`` is the list of microbatches of rank ``r``, each a list of sample indices."""


def desc_order(costs: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Sample indices, costliest first."""
    # Ties by more tokens, then by index, so the plan never depends on sort stability.
    return np.lexsort((np.arange(costs.size), -tokens, -costs))


def lpt(costs: np.ndarray, order: np.ndarray, n_bins: int) -> np.ndarray:
    """Longest-processing-time greedy: each item (costliest first) to the least loaded bin. Returns bin per item."""
    # Ties on load go to the bin with fewer items, so zero-cost samples still spread over the ranks.
    heap = [(0.0, 0, b) for b in range(n_bins)]
    bin_of = np.empty(costs.size, dtype=np.int64)
    for i in order.tolist():
        load, count, b = heapq.heappop(heap)
        bin_of[i] = b
        heapq.heappush(heap, (load + costs[i], count + 1, b))
    return bin_of


def pack_ffd(members: np.ndarray, tokens: np.ndarray, budget: int) -> list[list[int]]:
    """First-fit decreasing on tokens: as few microbatches as the budget allows (FFD uses <= 11/9 OPT + 1)."""
    if members.size == 0:
        return []
    members = members[np.lexsort((members, -tokens[members]))]
    bins: list[list[int]] = []
    room: list[int] = []
    for i in members.tolist():
        t = int(tokens[i])
        for b, free in enumerate(room):
            if t <= free:
                bins[b].append(i)
                room[b] = free - t
                break
        else:
            bins.append([i])
            # An oversize sample (t > budget) gets a closed microbatch of its own.
            room.append(max(budget - t, -1) if t <= budget else -1)
    return bins


def refine_totals(costs: np.ndarray, rank_of: np.ndarray, world: int, max_iters: int | None = None) -> np.ndarray:
    """Local search on the largest per-rank total: moves and swaps out of the most loaded rank while one helps.

    The lockstep planner's local search (`odc_accelerate.planning.lockstep`) for one slot without a token capacity,
    with fewer array ops: the best receiver of a single move is always the least loaded rank, so moves need no
    matrix; swaps are scored the same way. Returns the refined rank of every sample.
    """
    rank_of = rank_of.copy()
    load = np.bincount(rank_of, weights=costs, minlength=world)
    count = np.bincount(rank_of, minlength=world)
    eps = 1e-12 * max(float(load.max()), 1e-300)
    if max_iters is None:
        max_iters = 4 * costs.size + 8
    for _ in range(max_iters):
        a = int(np.argmax(load))
        ca = load[a]
        load[a] = -np.inf
        m2 = load.max()
        lightest = int(np.argmin(load))
        load[a] = ca
        xs = np.flatnonzero(rank_of == a)
        cx = costs[xs]
        best_score, best = 0.0, None
        if count[a] >= 2:
            new_b = load[lightest] + cx
            new_a = ca - cx
            score = (ca - np.maximum(np.maximum(new_a, m2), new_b)) + 1e-6 * (ca - np.maximum(new_a, new_b))
            score[new_b >= ca - eps] = -1.0
            k = int(np.argmax(score))
            if score[k] > best_score:
                best_score, best = float(score[k]), (int(xs[k]), lightest, -1)
        cb_all = load[rank_of]
        ys = np.flatnonzero((rank_of != a) & (costs < cx.max() - eps) & (costs > cx.min() - (ca - cb_all)))
        if ys.size:
            d = cx[:, None] - costs[ys][None, :]
            new_b = cb_all[ys][None, :] + d
            new_a = ca - d
            score = (ca - np.maximum(np.maximum(new_a, m2), new_b)) + 1e-6 * (ca - np.maximum(new_a, new_b))
            score[(d <= eps) | (new_b >= ca - eps)] = -1.0
            flat = int(np.argmax(score))
            if score.flat[flat] > best_score:
                y = int(ys[flat % ys.size])
                best = (int(xs[flat // ys.size]), int(rank_of[y]), y)
        if best is None:
            break
        x, b, y = best
        if y < 0:
            load[a] -= costs[x]
            load[b] += costs[x]
            count[a] -= 1
            count[b] += 1
            rank_of[x] = b
        else:
            delta = costs[x] - costs[y]
            load[a] -= delta
            load[b] += delta
            rank_of[x], rank_of[y] = b, a
    return rank_of


def assign_slots_to_ranks(costs: np.ndarray, tokens: np.ndarray, bin_of: np.ndarray, n_slots: int, world: int) -> Plan:
    """Hand the bins of each slot to ranks so that per-rank totals also come out balanced (costliest slot first)."""
    n_bins = n_slots * world
    members: list[list[int]] = [[] for _ in range(n_bins)]
    for i in desc_order(costs, tokens).tolist():
        members[bin_of[i]].append(i)
    bcost = np.bincount(bin_of, weights=costs, minlength=n_bins)
    plan: Plan = [[[] for _ in range(n_slots)] for _ in range(world)]
    totals = np.zeros(world)
    slot_order = sorted(range(n_slots), key=lambda s: (-bcost[s * world : (s + 1) * world].max(), s))
    for s in slot_order:
        bins = list(range(s * world, (s + 1) * world))
        bins.sort(key=lambda b: (-bcost[b], b))
        ranks = np.lexsort((np.arange(world), totals)).tolist()  # least loaded rank first
        for b, r in zip(bins, ranks, strict=True):
            plan[r][s] = members[b]
            totals[r] += bcost[b]
    # Drop slots that are empty on every rank (only possible after refinement emptied nothing; kept for safety).
    keep = [s for s in range(n_slots) if any(plan[r][s] for r in range(world))]
    if len(keep) != n_slots:
        plan = [[plan[r][s] for s in keep] for r in range(world)]
    return plan
