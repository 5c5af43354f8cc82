"""Step planning for padded collation (TRL's DPO collator, SFT without ``padding_free``, `DataCollatorWithPadding`).

A padded microbatch costs ``sum(rows) * row_cost(width)`` and holds ``sum(rows) * width`` tokens, so every plan sorts
the samples by width and cuts consecutive runs that fit the budget: ``free`` balances the ranks' padded totals (then a
local search), ``lockstep`` gives every rank the same number of runs, ``dynamic`` splits runs until the queue is long
enough and deals it round-robin. See docs/planning.md, "Padded shapes".
"""

from __future__ import annotations

import math

import numpy as np

from .dynamic import deal, min_queue_length, queue_order, split_until
from .packing import Plan, assign_slots_to_ranks, lpt, refine_totals
from .plan import PlanName, normalize_plan

__all__ = ["padded_microbatch", "plan_padded"]


def padded_microbatch(members: list[int], rows: np.ndarray, widths: np.ndarray) -> tuple[int, int]:
    """``(rows, width)`` of the tensor a padded collator builds from ``members`` (``(0, 0)`` when empty)."""
    if not members:
        return 0, 0
    return int(rows[members].sum()), int(widths[members].max())


def plan_padded(
    rows: np.ndarray,
    widths: np.ndarray,
    row_costs: np.ndarray,
    world_size: int,
    max_tokens_per_microbatch: int,
    plan: PlanName | str = PlanName.FREE,
    *,
    mode: str | None = None,
) -> Plan:
    """Plan one step for a padded collator (see the module docstring).

    A microbatch never holds more than ``max_tokens_per_microbatch`` padded tokens (``rows * width``), except a single
    sample that is larger on its own, which gets a microbatch of its own.

    Args:
        rows (`np.ndarray`): batch rows of each sample (1 for SFT, 2 for a DPO pair: chosen and rejected).
        widths (`np.ndarray`): tokens of each sample's longest row.
        row_costs (`np.ndarray`): cost of one row as wide as each sample (a cost non-decreasing in the width, so that
            a microbatch's rows all cost what its widest sample's row costs).
        world_size (`int`): number of ranks.
        max_tokens_per_microbatch (`int`): padded-token budget of one microbatch.
        plan (`PlanName` or `str`, *optional*, defaults to `"free"`): see `plan_step`.
        mode (`str`, *optional*): deprecated spelling of ``plan``.

    Returns:
        `list[list[list[int]]]`: ``plan[r]`` is the list of microbatches of rank ``r`` (indices into ``rows``).
    """
    plan = normalize_plan(plan, mode=mode)
    rows = np.asarray(rows, dtype=np.int64)
    widths = np.asarray(widths, dtype=np.int64)
    row_costs = np.asarray(row_costs, dtype=np.float64)
    if rows.shape != widths.shape or rows.shape != row_costs.shape or rows.ndim != 1:
        raise ValueError(
            "`rows`, `widths` and `row_costs` must be 1-D arrays of the same length, got "
            f"{rows.shape}, {widths.shape} and {row_costs.shape}"
        )
    if rows.size == 0:
        return [[] for _ in range(world_size)]
    if (rows < 1).any() or (widths < 0).any() or not np.all(np.isfinite(row_costs)) or (row_costs < 0).any():
        raise ValueError("every sample needs at least one row, a non-negative width and a finite, non-negative cost")
    layout = _Layout(rows, widths, row_costs, max_tokens_per_microbatch)
    if plan == PlanName.DYNAMIC:
        runs = split_until(
            layout.cut(layout.order.tolist()), min_queue_length(rows.size, world_size), layout.cost, layout.halve
        )
        return deal(queue_order(runs, [layout.cost(run) for run in runs]), world_size)
    if plan == PlanName.FREE or world_size == 1:
        return layout.plan_free(world_size)
    return layout.plan_lockstep(world_size)


class _Layout:
    """The step's samples with their padded shapes, and packing / costing of sample sets."""

    def __init__(self, rows: np.ndarray, widths: np.ndarray, row_costs: np.ndarray, budget: int) -> None:
        self.rows, self.widths, self.budget = rows, widths, int(budget)
        self.own = rows * row_costs  # a sample's cost padded to its own width: no plan makes it cheaper
        # Widest first; ties by index, so that plans never depend on sort stability.
        order = np.lexsort((np.arange(rows.size), -widths))
        pos = np.empty(rows.size, dtype=np.int64)
        pos[order] = np.arange(rows.size)
        self.order = order
        # Plain lists: the local search packs and costs small sample sets many times, where numpy's per-call
        # overhead would dominate.
        self._pos, self._rows, self._widths = pos.tolist(), rows.tolist(), widths.tolist()
        self._row_costs = row_costs.tolist()

    def cut(self, members: list[int]) -> list[list[int]]:
        """Cut ``members`` (any order) into widest-first consecutive runs that fit the budget."""
        runs: list[list[int]] = []
        run_rows = run_width = 0
        closed = True
        for i in sorted(members, key=self._pos.__getitem__):
            r, w = self._rows[i], self._widths[i]
            # Sorted widest first: the run's first sample sets its width.
            if not closed and (run_rows + r) * run_width <= self.budget:
                runs[-1].append(i)
                run_rows += r
            else:
                runs.append([i])
                run_rows, run_width = r, w
                closed = r * w > self.budget  # an oversize sample: its microbatch takes nothing else
        return runs

    def cost(self, run: list[int]) -> float:
        if not run:
            return 0.0
        return sum(self._rows[i] for i in run) * max(self._row_costs[i] for i in run)

    def total(self, members: list[int]) -> float:
        return sum(self.cost(run) for run in self.cut(members))

    # --------------------------------------------------------------------------------------------------- free
    def plan_free(self, world: int) -> Plan:
        if world == 1:
            return [self.cut(list(range(self.own.size)))]
        # Two starts, each improved by local search; the better one wins. (a) Ranks balanced on the samples' own
        # costs: each rank gets a spread of widths, so padding is left to the search. (b) The step's widest-first
        # runs dealt to ranks as wholes: like widths stay together (one rank may take all the wide samples), which
        # the search cannot reach from (a) with single moves and swaps.
        order = np.lexsort((np.arange(self.own.size), -self.widths, -self.own))
        rank_of = refine_totals(self.own, lpt(self.own, order, world), world)
        spread = [np.flatnonzero(rank_of == r).tolist() for r in range(world)]
        runs = self.cut(list(range(self.own.size)))
        run_costs = np.array([self.cost(run) for run in runs])
        run_rank = lpt(run_costs, np.lexsort((np.arange(len(runs)), -run_costs)), world)
        grouped = [[i for k, run in enumerate(runs) if run_rank[k] == r for i in run] for r in range(world)]
        best = None
        for members in (self._improve(spread), self._improve(grouped)):
            self._fill_idle(members)
            plan = [self.cut(m) for m in members]
            key = (max(sum(self.cost(run) for run in rank) for rank in plan), sum(len(rank) for rank in plan))
            if best is None or key < best[0]:
                best = (key, plan)
        return best[1]

    def _fill_idle(self, members: list[list[int]]) -> None:
        """No rank idles while there are enough samples (only zero-cost samples can leave one idle here): an idle
        rank takes the cheapest sample of the rank holding the most."""
        while self.own.size >= len(members) and any(not m for m in members):
            empty = next(r for r, m in enumerate(members) if not m)
            donor = max(range(len(members)), key=lambda r: (len(members[r]), -r))
            x = min(members[donor], key=lambda i: (self._row_costs[i] * self._rows[i], -self._pos[i]))
            members[donor].remove(x)
            members[empty].append(x)

    def _improve(self, members: list[list[int]], max_iters: int | None = None) -> list[list[int]]:
        """Moves and swaps out of the rank with the largest padded total while that lowers it.

        Receivers of a move are the three least loaded ranks, swaps go to the least loaded one, and a gain below 0.1%
        stops the search: it refines a start that is already near balance, at a bounded planning cost.
        """
        world = len(members)
        totals = [self.total(m) for m in members]
        if max_iters is None:
            max_iters = world + 8
        for _ in range(max_iters):
            a = max(range(world), key=lambda r: (totals[r], -r))
            current = totals[a]
            eps = 1e-3 * current  # a gain below 0.1% is not worth more planning time
            others = sorted((r for r in range(world) if r != a), key=lambda r: (totals[r], r))
            # Candidates (new max of the two ranks, their new sum, x, receiver, swapped y or -1). Best = lowest max,
            # then lowest sum (less padding): without the second key a tie picks moves that only shift padding around
            # and stop the search.
            candidates: list[tuple[float, float, int, int, int]] = []
            if len(members[a]) >= 2:
                for x in members[a]:
                    new_a = self.total([i for i in members[a] if i != x])
                    for b in others[:3]:
                        new_b = self.total([*members[b], x])
                        candidates.append((max(new_a, new_b), new_a + new_b, x, b, -1))
            b = others[0]
            for x in members[a]:
                rest = [i for i in members[a] if i != x]
                for y in members[b]:
                    new_a = self.total([*rest, y])
                    new_b = self.total([*(i for i in members[b] if i != y), x])
                    candidates.append((max(new_a, new_b), new_a + new_b, x, b, y))
            best = min(candidates, default=None)
            if best is None or best[0] >= current - eps:
                break
            _, _, x, b, y = best
            members[a] = [i for i in members[a] if i != x]
            members[b] = [i for i in members[b] if i != y] + [x]
            if y >= 0:
                members[a].append(y)
            totals[a], totals[b] = self.total(members[a]), self.total(members[b])
        return members

    def halve(self, run: list[int]) -> tuple[list[int], list[int]]:
        """A widest-first run cut in two where the costlier part is cheapest."""
        cut = min(range(1, len(run)), key=lambda c: (max(self.cost(run[:c]), self.cost(run[c:])), c))
        return run[:cut], run[cut:]

    # ----------------------------------------------------------------------------------------------- lockstep
    def plan_lockstep(self, world: int) -> Plan:
        runs = self.cut(self.order.tolist())
        slots = math.ceil(len(runs) / world)
        # Every rank needs `slots` microbatches: split the costliest runs (at their best cut) until there are enough.
        while len(runs) < slots * world:
            splittable = [k for k, run in enumerate(runs) if len(run) >= 2]
            if not splittable:
                break  # fewer samples than microbatch places: some stay empty
            k = max(splittable, key=lambda j: (self.cost(runs[j]), -j))
            runs[k : k + 1] = list(self.halve(runs[k]))
        runs += [[] for _ in range(slots * world - len(runs))]
        # Runs of similar cost share a slot (the slot waits for its costliest run).
        runs.sort(key=lambda run: (-self.cost(run), min(run, default=-1)))
        bin_of = np.empty(self.rows.size, dtype=np.int64)
        for b, run in enumerate(runs):
            bin_of[run] = b
        return assign_slots_to_ranks(self.own, self.rows * self.widths, bin_of, slots, world)
