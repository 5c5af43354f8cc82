"""The ``"lockstep"`` plan: the same number of microbatches on every rank, every microbatch slot balanced.

Plain FSDP2 synchronises every rank at every layer of every microbatch, so a step costs ``sum_k max_r C_rk`` over
microbatch slots k (LB-Micro in the ODC paper, "Revisiting Parameter Server in LLM Post-Training").
"""

from __future__ import annotations

import bisect
import heapq
import math

import numpy as np

from .packing import Plan, assign_slots_to_ranks, desc_order

__all__ = ["plan_lockstep"]


def plan_lockstep(costs: np.ndarray, tokens: np.ndarray, world: int, budget: int) -> Plan:
    """Minimise ``sum_k max_r cost(plan[r][k])`` with the same number of microbatches on every rank.

    Fills slots one at a time up to the level set by the costliest remaining sample while single samples dominate,
    spreads the rest over equal-cost microbatches (LPT under the token budget), then moves or swaps samples out of
    each slot's costliest microbatch. Within a slot, microbatches go to ranks so that the per-rank totals are
    balanced too. A microbatch is an empty list only where that cannot be avoided.

    Args:
        costs (`np.ndarray`): float64 cost of each sample.
        tokens (`np.ndarray`): int64 token count of each sample.
        world (`int`): number of ranks.
        budget (`int`): token budget of one microbatch.
    """
    n = costs.size
    order = desc_order(costs, tokens)
    oversize = tokens > budget
    remaining = order.tolist()
    slots: list[list[list[int]]] = []  # slots[k][j] = items of bin j of slot k (bins not yet tied to ranks)

    # Phase 1: while the costliest remaining sample costs more than the average slot level, the slot holding
    # it costs at least that much anyway, so fill every other microbatch of that slot up to the same level
    # (work that adds nothing to the step's cost and that later slots no longer have to carry).
    while remaining:
        rem = np.asarray(remaining)
        k_min = _min_slots(tokens[rem], oversize[rem], world, budget)
        top = costs[remaining[0]]
        if top <= costs[rem].sum() / (world * k_min) or len(remaining) <= world:
            break
        slot, left = _fill_slot(remaining, costs, tokens, world, budget, top)
        if len(left) == len(remaining):  # cannot happen (the costliest sample always fits an empty bin); no hang
            break
        slots.append(slot)
        remaining = left

    # Phase 2: the rest is fine-grained relative to the slot level: spread it over k * world bins of equal
    # cost (LPT under the token budget), then group bins of similar cost into slots.
    if remaining:
        slots.extend(_lpt_slots(remaining, costs, tokens, oversize, world, budget))

    bin_items = [b for slot in slots for b in slot]
    n_slots = len(slots)
    bin_slot = np.repeat(np.arange(n_slots), world)
    bin_of = np.empty(n, dtype=np.int64)
    for b, items in enumerate(bin_items):
        bin_of[items] = b
    bin_of = _fill_empty_bins(costs, bin_of, bin_slot)
    bin_of = _refine(costs, tokens, bin_of, bin_slot, capacity=budget)
    return assign_slots_to_ranks(costs, tokens, bin_of, n_slots, world)


def _min_slots(tok: np.ndarray, over: np.ndarray, world: int, budget: int) -> int:
    # Lower bound on the slots the remaining samples need: budget-full microbatches for the normal ones, and one
    # microbatch each for the oversize ones.
    normal_tokens = int(tok[~over].sum())
    n_over = int(over.sum())
    bins_needed = n_over + math.ceil(normal_tokens / budget)
    return max(1, math.ceil(bins_needed / world))


def _fill_slot(
    remaining: list[int], costs: np.ndarray, tokens: np.ndarray, world: int, budget: int, level: float
) -> tuple[list[list[int]], list[int]]:
    """Fill ``world`` microbatches up to cost ``level`` with the costliest samples that fit (worst-fit decreasing)."""
    cost_of = costs[remaining].tolist()
    tok_of = tokens[remaining].tolist()
    # suffix_min[p]: fewest tokens of any sample from position p on; a bin with less room than that is closed.
    suffix_min = np.minimum.accumulate(np.asarray(tok_of)[::-1])[::-1].tolist() + [budget + 1]
    smallest = min(cost_of)
    bins: list[list[int]] = [[] for _ in range(world)]
    btok = [0] * world
    # Open bins sorted by current cost (cheapest first), so the first one that fits is the least loaded.
    by_cost = [(0.0, j) for j in range(world)]
    left: list[int] = []
    limit = level * (1 + 1e-12)
    max_room = math.inf  # an empty bin takes anything, even an oversize sample
    for pos, i in enumerate(remaining):
        if not by_cost or by_cost[0][0] + smallest > limit:
            left.extend(remaining[pos:])  # every bin is full: nothing else can go in
            break
        c, t = cost_of[pos], tok_of[pos]
        if t > max_room:
            left.append(i)  # no open bin has the tokens to spare
            continue
        placed = False
        k = 0
        while k < len(by_cost):
            bc, j = by_cost[k]
            if bc + c > limit:
                break  # sorted by cost: no later bin has more room
            if btok[j] + t <= budget or not bins[j]:
                bins[j].append(i)
                btok[j] += t
                del by_cost[k]
                # Keep the bin open only if it can still take a sample (an oversize sample closes it).
                if t <= budget and budget - btok[j] >= suffix_min[pos + 1]:
                    bisect.insort(by_cost, (bc + c, j))
                placed = True
                break
            if budget - btok[j] < suffix_min[pos]:
                del by_cost[k]  # too full for any remaining sample
                continue
            k += 1
        if placed:
            max_room = max((budget - btok[j] if bins[j] else math.inf for _, j in by_cost), default=-1)
        else:
            left.append(i)
    return bins, left


def _lpt_slots(
    remaining: list[int], costs: np.ndarray, tokens: np.ndarray, oversize: np.ndarray, world: int, budget: int
) -> list[list[list[int]]]:
    rem = np.asarray(remaining)
    k = _min_slots(tokens[rem], oversize[rem], world, budget)
    while True:
        bins = _lpt_capacity(remaining, costs, tokens, k * world, budget)
        if bins is not None:
            break
        k += 1
    bcost = np.array([costs[b].sum() if b else 0.0 for b in bins])
    # Sorting bins by cost and grouping neighbours makes the slot maxima as small as these bins allow.
    ranked = np.lexsort((np.arange(len(bins)), -bcost))
    slots = [[bins[j] for j in ranked[s * world : (s + 1) * world]] for s in range(k)]
    return [slot for slot in slots if any(slot)]


def _lpt_capacity(
    remaining: list[int], costs: np.ndarray, tokens: np.ndarray, n_bins: int, budget: int
) -> list[list[int]] | None:
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    btok = [0] * n_bins
    heap = [(0.0, 0, j) for j in range(n_bins)]  # (cost, items, bin): least loaded first, then emptiest
    parked = []
    for i in remaining:
        t = int(tokens[i])
        parked.clear()
        while heap:
            bc, count, j = heapq.heappop(heap)
            if btok[j] + t <= budget or not bins[j]:
                bins[j].append(i)
                btok[j] += t
                if t <= budget:  # an oversize sample closes its bin
                    heapq.heappush(heap, (bc + costs[i], count + 1, j))
                break
            parked.append((bc, count, j))
        else:
            return None
        for entry in parked:
            heapq.heappush(heap, entry)
    return bins


def _fill_empty_bins(costs: np.ndarray, bin_of: np.ndarray, bin_slot: np.ndarray) -> np.ndarray:
    """Give every empty microbatch the cheapest sample of a microbatch that holds several, while any has several."""
    n_bins = bin_slot.size
    counts = np.bincount(bin_of, minlength=n_bins)
    empty = np.flatnonzero(counts == 0).tolist()
    if not empty:
        return bin_of
    bin_of = bin_of.copy()
    order = np.lexsort((np.arange(costs.size), costs)).tolist()  # cheapest first
    for b in empty:
        for i in order:
            src = bin_of[i]
            if counts[src] >= 2:
                counts[src] -= 1
                counts[b] += 1
                bin_of[i] = b
                break
        else:
            break  # every non-empty microbatch holds one sample: the remaining empties are unavoidable
    return bin_of


def _refine(
    costs: np.ndarray,
    tokens: np.ndarray,
    bin_of: np.ndarray,
    bin_slot: np.ndarray,
    capacity: int | None,
    max_iters: int | None = None,
) -> np.ndarray:
    """Local search on ``sum over slots of the costliest bin in the slot`` (one slot: the free plan's ``max_r C_r``).

    Repeatedly takes the costliest bin ``a`` of a slot and applies the best single move (one sample from ``a`` to
    another bin) or swap (a sample of ``a`` against a cheaper one elsewhere) such that the receiving bin stays
    strictly below its own slot's maximum and within the token ``capacity``. Every accepted step lowers the
    slot's maximum or the number of bins tied at it and raises no other slot's maximum, so the search terminates;
    ``max_iters`` bounds its time.
    """
    n = costs.size
    n_bins = bin_slot.size
    n_slots = int(bin_slot.max()) + 1
    bin_of = bin_of.copy()
    cap = np.inf if capacity is None else float(capacity)
    bcost = np.bincount(bin_of, weights=costs, minlength=n_bins)
    btok = np.bincount(bin_of, weights=tokens, minlength=n_bins)
    bcnt = np.bincount(bin_of, minlength=n_bins)
    tok_f = tokens.astype(np.float64)
    if max_iters is None:
        max_iters = 4 * n + 8 * n_slots
    # Relative tolerance: improvements smaller than this are float noise and must not count as progress.
    eps = 1e-12 * max(float(bcost.max()), 1e-300)
    slot_bins = [np.flatnonzero(bin_slot == s) for s in range(n_slots)]
    stuck = np.zeros(n_slots, dtype=bool)
    slot_max = np.array([bcost[sb].max() for sb in slot_bins])
    iters = 0
    bins_per_slot = np.bincount(bin_slot, minlength=n_slots)
    while iters < max_iters and not stuck.all():
        # Work on the slot whose maximum stands out most above its own mean: that is where the waste is.
        if n_slots == 1:
            s = 0
        else:
            excess = slot_max - np.bincount(bin_slot, weights=bcost, minlength=n_slots) / bins_per_slot
            s = int(np.argmax(np.where(stuck, -np.inf, excess)))
        sb = slot_bins[s]
        a = int(sb[np.argmax(bcost[sb])])
        ca = bcost[a]
        others = bcost[sb][sb != a]
        m2 = others.max() if others.size else -np.inf
        limit = slot_max[bin_slot]  # receiving bin must stay strictly below its slot's maximum
        xs = np.flatnonzero(bin_of == a)
        cx = costs[xs][:, None]
        tx = tok_f[xs][:, None]

        best_gain, best = -1.0, None
        # Moves x -> b.
        if bcnt[a] >= 2:
            new_b = bcost[None, :] + cx
            ok = (new_b < limit[None, :] - eps) & (btok[None, :] + tx <= cap)
            ok[:, a] = False
            if ok.any():
                same = (bin_slot == s)[None, :]
                new_a = ca - cx
                peak = np.maximum(np.maximum(new_a, m2), np.where(same, new_b, -np.inf))
                own = ca - np.maximum(new_a, np.where(same, new_b, -np.inf))
                score = np.where(ok, (ca - peak) + 1e-6 * own, -1.0)
                flat = int(np.argmax(score))
                if score.flat[flat] > 0:
                    best_gain = float(score.flat[flat])
                    best = ("move", int(xs[flat // n_bins]), flat % n_bins)
        # Swaps x <-> y with cost(x) > cost(y). Pre-filter y with conditions that some x must meet (cheaper than
        # the costliest x; the cost difference fits below y's slot maximum), so the matrix below stays small.
        room = (limit - bcost)[bin_of]
        ys_mask = (bin_of != a) & (costs < cx.max() - eps) & (costs > cx.min() - room)
        if ys_mask.any():
            ys = np.flatnonzero(ys_mask)
            by = bin_of[ys]
            d = cx - costs[ys][None, :]
            dt = tx - tok_f[ys][None, :]
            new_b = bcost[by][None, :] + d
            ok = (
                (d > eps)
                & (new_b < limit[by][None, :] - eps)
                & (btok[by][None, :] + dt <= cap)
                & (btok[a] - dt <= cap)
            )
            if ok.any():
                same = (bin_slot[by] == s)[None, :]
                new_a = ca - d
                peak = np.maximum(np.maximum(new_a, m2), np.where(same, new_b, -np.inf))
                own = ca - np.maximum(new_a, np.where(same, new_b, -np.inf))
                score = np.where(ok, (ca - peak) + 1e-6 * own, -1.0)
                flat = int(np.argmax(score))
                if score.flat[flat] > max(best_gain, 0.0):
                    best = ("swap", int(xs[flat // ys.size]), int(ys[flat % ys.size]))
        iters += 1
        if best is None:
            stuck[s] = True
            continue
        if best[0] == "move":
            _, x, b = best
            bcost[a] -= costs[x]
            btok[a] -= tokens[x]
            bcnt[a] -= 1
            bcost[b] += costs[x]
            btok[b] += tokens[x]
            bcnt[b] += 1
            bin_of[x] = b
        else:
            _, x, y = best
            b = int(bin_of[y])
            delta_c = costs[x] - costs[y]
            delta_t = tokens[x] - tokens[y]
            bcost[a] -= delta_c
            btok[a] -= delta_t
            bcost[b] += delta_c
            btok[b] += delta_t
            bin_of[x], bin_of[y] = b, a
        for t in {s, int(bin_slot[b])}:
            slot_max[t] = bcost[slot_bins[t]].max()
        # Bin a got cheaper, so it may now take work from slots that were stuck: look at all of them again.
        stuck[:] = False
    return bin_of
