"""The step planner: split one optimizer step's samples over ranks and microbatches with balanced cost.

Pure functions over numpy arrays (no torch, no torch.distributed), so every rank computes the same global plan from
the same inputs. Three plans: ``"free"`` (`.free`: a step costs the largest per-rank total, ranks may run different
numbers of microbatches), ``"lockstep"`` (`.lockstep`: plain FSDP2's cost, the sum over slots of each slot's costliest
microbatch) and ``"dynamic"`` (`.dynamic`: one queue claimed while the step runs). See docs/planning.md.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..validation import check_positive_int
from .cost import CostSpec, QuadraticCost, check_costs, resolve_cost
from .dynamic import plan_dynamic
from .free import plan_free
from .lockstep import plan_lockstep
from .packing import Plan

__all__ = [
    "PLANS",
    "Plan",
    "PlanName",
    "as_lengths",
    "check_oversize",
    "normalize_plan",
    "plan_from_costs",
    "plan_step",
]


class PlanName(str, enum.Enum):
    """A plan's name. A `str`: each member equals, prints and goes to JSON as its value (``PlanName.FREE == "free"``),
    so config files, flags, environment variables, logs and JSON spell plans as plain names (``yaml.safe_dump`` takes
    ``str(plan)``)."""

    FREE = "free"
    LOCKSTEP = "lockstep"
    DYNAMIC = "dynamic"

    # A mixed-in Enum's `str()` and `repr()` name the member (``PlanName.FREE``) and from Python 3.12 `format()` follows
    # `str()`: the value in all three keeps banners, log lines, messages and reprs as they read with plain strings.
    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)


PLANS: tuple[str, ...] = tuple(plan.value for plan in PlanName)
"""The plan names, the default first."""

# Old spellings, accepted with a FutureWarning for one release.
_RENAMED_PLANS = {"odc": "free"}

_BUDGET = "`max_tokens_per_microbatch` (the most tokens one forward/backward can hold in memory)"


def normalize_plan(plan: PlanName | str, where: str = "plan", *, mode: str | None = None) -> PlanName:
    """Check a plan name and return it as a `PlanName` (its current spelling).

    The old spellings keep working for one release with a `FutureWarning`: the value ``"odc"`` (now ``"free"``) and the
    keyword ``mode=`` (now ``plan=``; callers hand its value on as ``mode``).

    Args:
        plan (`PlanName` or `str`):
            One of `PLANS`.
        where (`str`, *optional*, defaults to `"plan"`):
            The option's name in messages, e.g. ``"odc_plan (ODC_PLAN)"``.
        mode (`str`, *optional*):
            Value of a deprecated ``mode=`` keyword; it replaces ``plan``, which must then be left at its default.

    Raises:
        ValueError: the name is not one of `PLANS`.
    """
    if mode is not None:
        _deprecated("`mode=`", "`plan=`")
        if plan != PLANS[0]:
            raise TypeError(f"Pass `plan={plan!r}` alone, without the deprecated `mode={mode!r}`.")
        plan = mode
    if isinstance(plan, str) and plan in _RENAMED_PLANS:
        _deprecated(f"{where} {plan!r}", repr(_RENAMED_PLANS[plan]))
        plan = _RENAMED_PLANS[plan]
    if plan not in PLANS:
        raise ValueError(f"Unknown {where} {plan!r}; choose one of {', '.join(map(repr, PLANS))}.")
    return PlanName(plan)


def _deprecated(old: str, new: str) -> None:
    # stacklevel 4: the user's call of the public function that called `normalize_plan`.
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}.", FutureWarning, 4)


def sample_parts(lengths: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(parts, totals)`` of 1-D lengths or of a 2-D ``(samples, k)`` array (``k`` sequences that travel together, e.g.
    a DPO pair): ``parts`` is ``(samples, k)`` int64, ``totals`` its row sums. Raises `ValueError` as `as_lengths`."""
    parts = np.asarray(lengths)
    if parts.ndim == 2:
        if parts.shape[1] < 1:
            raise ValueError(f"2-D `lengths` must have at least one column (sequences per row), got {parts.shape}.")
        parts = as_lengths(parts.reshape(-1)).reshape(parts.shape)
        return parts, parts.sum(axis=1)
    totals = as_lengths(lengths)
    return totals[:, None], totals


def as_lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """``lengths`` as a 1-D int64 array of token counts, or a `ValueError` saying what is wrong with it.

    Whole-number floats are accepted; negative, fractional or non-finite values are not.

    Args:
        lengths (`Sequence[int]` or `np.ndarray`): token count of every sample.
    """
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"`lengths` must be a 1-D sequence of token counts, got shape {arr.shape}.")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise ValueError(f"`lengths` must hold integer token counts, got dtype {arr.dtype}.")
    if arr.min() < 0:
        bad = int(np.argmin(arr))
        raise ValueError(f"`lengths` must be non-negative, but lengths[{bad}] = {int(arr[bad])}.")
    return arr.astype(np.int64, copy=False)


def check_oversize(
    lengths: np.ndarray, max_tokens_per_microbatch: int, index_map: Sequence[int] | None = None
) -> None:
    """Raise a `ValueError` naming the first sample longer than the microbatch budget, if any.

    Args:
        lengths (`np.ndarray`): token counts.
        max_tokens_per_microbatch (`int`): the budget.
        index_map (`Sequence[int]`, *optional*): index to report for each position (e.g. dataset indices).
    """
    over = np.flatnonzero(np.asarray(lengths) > max_tokens_per_microbatch)
    if over.size:
        pos = int(over[0])
        idx = pos if index_map is None else int(index_map[pos])
        raise ValueError(
            f"Sample {idx} has {int(lengths[pos])} tokens, more than max_tokens_per_microbatch="
            f"{max_tokens_per_microbatch} ({over.size} sample(s) in all). Raise the budget, truncate or filter "
            "these samples, or pass allow_oversize=True to give each its own microbatch."
        )


def plan_step(
    lengths: Sequence[int] | np.ndarray,
    world_size: int,
    max_tokens_per_microbatch: int = 8192,
    cost: CostSpec | QuadraticCost = "auto",
    plan: PlanName | str = PlanName.FREE,
    *,
    model_config: Any = None,
    allow_oversize: bool = True,
    mode: str | None = None,
) -> Plan:
    """Plan one optimizer step: split samples over ranks and microbatches with balanced cost.

    Every index of ``lengths`` appears exactly once in the plan. A microbatch never holds more than
    ``max_tokens_per_microbatch`` tokens, except a single sample longer than that, which gets a microbatch of
    its own (or raises with ``allow_oversize=False``).

    ``plan="free"`` balances the per-rank totals (`~odc_accelerate.planning.free.plan_free`), ``"lockstep"`` every
    microbatch slot (`~odc_accelerate.planning.lockstep.plan_lockstep`), ``"dynamic"`` queues the microbatches
    costliest first, dealt round-robin (`claim_queue`); docs/planning.md, "Three plans".

    Args:
        lengths (`Sequence[int]` or `np.ndarray`):
            Token count of every sample of the step.
        world_size (`int`):
            Number of data-parallel ranks.
        max_tokens_per_microbatch (`int`, *optional*, defaults to 8192):
            Token budget of one microbatch.
        cost (`"auto"`, `"tokens"`, `QuadraticCost` or callable, *optional*, defaults to `"auto"`):
            Cost of one sample as a function of its length, see `resolve_cost`. ``"auto"`` derives it from
            ``model_config`` (linear FLOPs + causal attention, `cost_from_config`) or, without a config, uses the
            published 7B fit ``4.348 x^2 + 8.768 x`` with ``x = L / 32000``.
        plan (`PlanName` or `str`: `"free"`, `"lockstep"` or `"dynamic"`, *optional*, defaults to `"free"`):
            Balance per-rank totals (with ODC), every microbatch slot (plain FSDP2), or queue the microbatches for
            ranks to claim while the step runs (with ODC).
        model_config (`PretrainedConfig`, *optional*):
            Model configuration used by ``cost="auto"``.
        allow_oversize (`bool`, *optional*, defaults to `True`):
            Whether a sample longer than the budget may get a microbatch of its own. With `False` such a sample
            raises a `ValueError` (naming it) before any planning.
        mode (`str`, *optional*):
            Deprecated spelling of ``plan``.

    Returns:
        `list[list[list[int]]]`: ``plan[r]`` is the list of microbatches of rank ``r``, each a list of indices
        into ``lengths``.
    """
    lengths_arr = as_lengths(lengths)
    world_size = check_positive_int(world_size, "`world_size`")
    max_tokens_per_microbatch = check_positive_int(max_tokens_per_microbatch, _BUDGET)
    plan = normalize_plan(plan, mode=mode)
    if not allow_oversize:
        check_oversize(lengths_arr, max_tokens_per_microbatch)
    costs = check_costs(resolve_cost(cost, model_config)(lengths_arr))
    return _dispatch(costs, lengths_arr, world_size, max_tokens_per_microbatch, plan)


def plan_from_costs(
    costs: np.ndarray,
    tokens: np.ndarray,
    world_size: int,
    max_tokens_per_microbatch: int,
    plan: PlanName | str = PlanName.FREE,
    *,
    mode: str | None = None,
) -> Plan:
    """`plan_step` on precomputed costs (only the plan name is checked; the sampler computes costs once per dataset).

    Args:
        costs (`np.ndarray`): float64 cost of each sample.
        tokens (`np.ndarray`): int64 token count of each sample.
        world_size (`int`): number of ranks.
        max_tokens_per_microbatch (`int`): token budget of one microbatch.
        plan (`PlanName` or `str`, *optional*, defaults to `"free"`): see `plan_step`.
        mode (`str`, *optional*): deprecated spelling of ``plan``.
    """
    plan = normalize_plan(plan, mode=mode)
    return _dispatch(costs, tokens, world_size, max_tokens_per_microbatch, plan)


def _dispatch(costs: np.ndarray, tokens: np.ndarray, world_size: int, budget: int, plan: PlanName) -> Plan:
    costs = np.asarray(costs, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    if costs.size == 0:
        return [[] for _ in range(world_size)]
    if plan == PlanName.DYNAMIC:
        return plan_dynamic(costs, tokens, world_size, budget)
    if plan == PlanName.FREE or world_size == 1:
        # On one rank nobody waits for anybody: both plans reduce to packing into as few microbatches as possible.
        return plan_free(costs, tokens, world_size, budget)
    return plan_lockstep(costs, tokens, world_size, budget)
