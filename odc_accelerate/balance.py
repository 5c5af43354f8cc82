"""Length-balanced step planning: cost models and partitioning.

Pure functions over numpy arrays (no torch, no torch.distributed), so every rank can compute the same
global plan from the same inputs without talking to the others.

Two planning modes, named after the ODC paper ("Revisiting Parameter Server in LLM Post-Training"):

- ``"odc"`` (LB-Mini): with On-Demand Communication ranks never wait for each other inside a step,
  so a step costs ``max_r C_r`` where ``C_r`` is the total work of rank r. The planner balances the
  per-rank totals first and only then cuts each rank's samples into as few microbatches as the token
  budget allows (ranks may end up with different numbers of microbatches).
- ``"lockstep"`` (LB-Micro): plain FSDP2 synchronises every rank at every layer of every microbatch,
  so a step costs ``sum_k max_r C_rk`` over microbatch slots k. Every rank gets the same number of
  microbatches and each slot is balanced across ranks.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "PUBLISHED_1_5B_COST",
    "PUBLISHED_7B_COST",
    "QuadraticCost",
    "check_oversize",
    "cost_from_config",
    "flops_cost",
    "lower_bound",
    "plan_from_costs",
    "plan_step",
    "resolve_cost",
    "step_metrics",
]

Plan = list[list[list[int]]]
CostSpec = Literal["auto", "tokens"] | Callable[[int], float]

_MODES = ("odc", "lockstep")


# --------------------------------------------------------------------------------------------------
# Cost models
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuadraticCost:
    """Per-sequence training cost ``linear * L + quadratic * L**2`` for a sequence of ``L`` tokens.

    Instances are callables that accept a length or an array of lengths (vectorised with numpy).
    Only ratios of costs matter to the planner, so the unit (FLOPs, seconds, arbitrary) is free.

    Args:
        linear (`float`):
            Cost per token (linear layers, LM head).
        quadratic (`float`):
            Cost per squared token (attention scores ``QK^T`` and ``AV``).
    """

    linear: float
    quadratic: float

    def __post_init__(self):
        if not (math.isfinite(self.linear) and math.isfinite(self.quadratic)) or self.linear < 0 or self.quadratic < 0:
            raise ValueError(
                f"QuadraticCost needs finite, non-negative coefficients, got linear={self.linear}, "
                f"quadratic={self.quadratic}."
            )
        if self.linear == 0 and self.quadratic == 0:
            raise ValueError("QuadraticCost needs at least one positive coefficient (all costs would be 0).")

    @classmethod
    def from_fit(cls, a: float, b: float, scale: float = 32000.0) -> QuadraticCost:
        """Build the cost ``a * x**2 + b * x`` with ``x = L / scale`` (the form the ODC authors publish).

        Args:
            a (`float`): quadratic coefficient of the fit.
            b (`float`): linear coefficient of the fit.
            scale (`float`, *optional*, defaults to 32000): length unit of the fit.
        """
        return cls(linear=b / scale, quadratic=a / (scale * scale))

    @property
    def quadratic_to_linear(self) -> float:
        """``quadratic / linear``: the length (in tokens) at which attention costs as much as the rest is its inverse."""
        return self.quadratic / self.linear if self.linear else math.inf

    def __call__(self, lengths):
        arr = np.asarray(lengths, dtype=np.float64)
        out = self.linear * arr + self.quadratic * arr * arr
        return float(out) if out.ndim == 0 else out


# Step-time fits published by the ODC authors for long-context SFT (x = L / 32000).
PUBLISHED_7B_COST = QuadraticCost.from_fit(4.348, 8.768)
PUBLISHED_1_5B_COST = QuadraticCost.from_fit(1.982, 2.612)


def flops_cost(
    num_layers: int,
    hidden_size: int,
    intermediate_size: int,
    num_attention_heads: int,
    num_key_value_heads: int | None = None,
    vocab_size: int = 0,
    head_dim: int | None = None,
    gated_mlp: bool = True,
    causal: bool = True,
    backward: bool = True,
) -> QuadraticCost:
    """Training FLOPs of one sequence for a dense decoder-only transformer, as a `QuadraticCost`.

    Derivation (a matmul of an ``[L, m]`` by an ``[m, n]`` operand costs ``2 * L * m * n`` FLOPs), per layer
    and per token, with ``d = num_attention_heads * head_dim`` and ``d_kv = num_key_value_heads * head_dim``:

    - attention projections: q ``2 h d``, k and v ``2 h d_kv`` each (grouped-query attention shrinks
      these), o ``2 d h``;
    - MLP: ``3 * 2 h I`` when gated (SwiGLU: gate, up, down), else ``2 * 2 h I``;
    - once per token, the LM head ``2 h V`` (the embedding lookup is free).

    Attention scores: ``QK^T`` and ``AV`` each cost ``2 L^2 d`` per layer for a full ``L x L`` score
    matrix (what eager attention computes and `torch.utils.flop_counter` counts). A causal kernel
    (flash / SDPA with ``is_causal``) only computes the lower triangle, so with ``causal=True`` (the default)
    the term is halved to ``2 L^2 d`` in total. Backward costs twice the forward for every matmul
    (gradients w.r.t. the input and the weight), hence the factor 3 with ``backward=True``.

    Result: ``linear = k * (num_layers * per_layer_linear + 2 h V)`` and
    ``quadratic = k * num_layers * (2 if causal else 4) * d`` with ``k = 3`` (forward + backward) or 1.

    Check against the published 7B step-time fit ``4.348 x^2 + 8.768 x`` (``x = L / 32000``), whose
    quadratic-to-linear ratio is ``1.55e-5`` per token: Qwen2.5-7B's config gives ``1.42e-5`` here (causal),
    within 9%; the remaining gap is kernel efficiency, which a FLOP count does not model.

    Args:
        num_layers (`int`): number of decoder layers.
        hidden_size (`int`): model width ``h``.
        intermediate_size (`int`): MLP width ``I`` (per active expert sum for MoE models).
        num_attention_heads (`int`): query heads.
        num_key_value_heads (`int`, *optional*): key/value heads (GQA); defaults to ``num_attention_heads``.
        vocab_size (`int`, *optional*, defaults to 0): LM head width; 0 leaves the head out.
        head_dim (`int`, *optional*): per-head width; defaults to ``hidden_size // num_attention_heads``.
        gated_mlp (`bool`, *optional*, defaults to `True`): whether the MLP has a gate projection (SwiGLU).
        causal (`bool`, *optional*, defaults to `True`): count only the causal half of the score matrix.
        backward (`bool`, *optional*, defaults to `True`): include the backward pass (x3).
    """
    for name, value in (
        ("num_layers", num_layers),
        ("hidden_size", hidden_size),
        ("intermediate_size", intermediate_size),
        ("num_attention_heads", num_attention_heads),
    ):
        if int(value) <= 0:
            raise ValueError(f"flops_cost needs a positive `{name}`, got {value}.")
    if vocab_size < 0:
        raise ValueError(f"flops_cost needs `vocab_size >= 0`, got {vocab_size}.")
    kv_heads = num_attention_heads if num_key_value_heads is None else int(num_key_value_heads)
    head_dim = hidden_size // num_attention_heads if head_dim is None else int(head_dim)
    if kv_heads <= 0 or head_dim <= 0:
        raise ValueError(f"flops_cost needs positive key/value heads and head_dim, got {kv_heads} and {head_dim}.")
    d_q = num_attention_heads * head_dim
    d_kv = kv_heads * head_dim
    h = hidden_size
    per_layer = 2 * h * d_q + 2 * 2 * h * d_kv + 2 * d_q * h + (3 if gated_mlp else 2) * 2 * h * intermediate_size
    passes = 3 if backward else 1
    linear = passes * (num_layers * per_layer + 2 * h * vocab_size)
    quadratic = passes * num_layers * (2 if causal else 4) * d_q
    return QuadraticCost(linear=float(linear), quadratic=float(quadratic))


# model_type values whose MLP is a plain up/act/down (no gate projection).
_UNGATED_MODEL_TYPES = frozenset(
    {"gpt2", "gpt_neox", "gptj", "gpt_bigcode", "opt", "bloom", "falcon", "phi", "starcoder2", "bert", "roberta"}
)


def cost_from_config(config: Any, causal: bool = True, gated_mlp: bool | None = None) -> QuadraticCost:
    """Model-derived training cost (see `flops_cost`) from a transformers config or any object with its fields.

    Reads Llama-style names (``num_hidden_layers``, ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim``, ``vocab_size``) and falls back to GPT-2 names (``n_layer``, ``n_embd``,
    ``n_inner``, ``n_head``). Multimodal configs use their text config. For mixture-of-experts configs with
    ``num_experts_per_tok`` and ``moe_intermediate_size`` the MLP counts the active experts (plus a shared expert
    when ``shared_expert_intermediate_size`` is set).

    Args:
        config (`PretrainedConfig` or `dict` or object):
            The model configuration.
        causal (`bool`, *optional*, defaults to `True`):
            Count only the causal half of the attention score matrix.
        gated_mlp (`bool`, *optional*):
            Whether the MLP is gated; guessed from ``model_type`` when not given (gated unless GPT-2-like).
    """
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    if isinstance(config, dict):
        get = config.get
    else:

        def get(name, default=None):
            return getattr(config, name, default)

    def first(*names):
        for name in names:
            value = get(name)
            if value is not None:
                return value
        return None

    layers = first("num_hidden_layers", "n_layer", "num_layers")
    hidden = first("hidden_size", "n_embd", "d_model")
    heads = first("num_attention_heads", "n_head")
    if layers is None or hidden is None or heads is None:
        raise ValueError(
            "cost_from_config could not read the number of layers, hidden size and attention heads from the config "
            f"({type(config).__name__}); pass `cost=flops_cost(...)` or a callable instead."
        )
    intermediate = first("intermediate_size", "n_inner", "ffn_dim")
    if intermediate is None:
        intermediate = 4 * hidden
    experts_per_tok = get("num_experts_per_tok")
    moe_intermediate = get("moe_intermediate_size")
    if experts_per_tok and moe_intermediate:
        intermediate = experts_per_tok * moe_intermediate + (get("shared_expert_intermediate_size") or 0)
    if gated_mlp is None:
        gated_mlp = get("model_type") not in _UNGATED_MODEL_TYPES
    return flops_cost(
        num_layers=int(layers),
        hidden_size=int(hidden),
        intermediate_size=int(intermediate),
        num_attention_heads=int(heads),
        num_key_value_heads=first("num_key_value_heads", "num_kv_heads"),
        vocab_size=int(get("vocab_size") or 0),
        head_dim=get("head_dim"),
        gated_mlp=bool(gated_mlp),
        causal=causal,
    )


def resolve_cost(
    cost: CostSpec | QuadraticCost = "auto", model_config: Any = None
) -> Callable[[np.ndarray], np.ndarray]:
    """Turn a ``cost`` argument into a vectorised function from an int64 length array to a float64 cost array.

    Args:
        cost (`"auto"`, `"tokens"`, `QuadraticCost` or callable, *optional*, defaults to `"auto"`):
            ``"tokens"``: cost = length. ``"auto"``: `cost_from_config(model_config)` when ``model_config`` is
            given, else the published 7B fit `PUBLISHED_7B_COST` (a reasonable shape for long-context SFT when
            the model is unknown). A callable maps one length (`int`) to a non-negative `float`; it is called once
            per distinct length.
        model_config (`PretrainedConfig`, *optional*):
            Model configuration used by ``cost="auto"``.
    """
    if isinstance(cost, str):
        if cost == "tokens":
            return lambda lengths: np.asarray(lengths, dtype=np.float64)
        if cost == "auto":
            return cost_from_config(model_config) if model_config is not None else PUBLISHED_7B_COST
        raise ValueError(f"Unknown cost {cost!r}: use 'auto', 'tokens', or a callable mapping a length to a float.")
    if model_config is not None:
        logger.warning("`model_config` is only used with cost='auto'; it is ignored for cost=%r.", cost)
    if isinstance(cost, QuadraticCost):
        return cost
    if not callable(cost):
        raise ValueError(f"`cost` must be 'auto', 'tokens' or a callable, got {type(cost).__name__}.")

    def per_length(lengths: np.ndarray) -> np.ndarray:
        lengths = np.asarray(lengths)
        uniq, inverse = np.unique(lengths, return_inverse=True)
        values = np.array([float(cost(int(u))) for u in uniq], dtype=np.float64)
        return values[inverse.reshape(lengths.shape)]

    return per_length


def _as_lengths(lengths) -> np.ndarray:
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


def _check_costs(costs: np.ndarray) -> np.ndarray:
    costs = np.asarray(costs, dtype=np.float64)
    if costs.size and not (np.all(np.isfinite(costs)) and costs.min() >= 0):
        bad = int(np.flatnonzero(~np.isfinite(costs) | (costs < 0))[0])
        raise ValueError(f"The cost function returned {costs[bad]} for sample {bad}; costs must be finite and >= 0.")
    return costs


# --------------------------------------------------------------------------------------------------
# Public planner
# --------------------------------------------------------------------------------------------------


def plan_step(
    lengths: Sequence[int] | np.ndarray,
    world_size: int,
    max_tokens_per_microbatch: int = 8192,
    cost: CostSpec | QuadraticCost = "auto",
    mode: Literal["odc", "lockstep"] = "odc",
    *,
    model_config: Any = None,
    allow_oversize: bool = True,
) -> Plan:
    """Plan one optimizer step: split samples over ranks and microbatches with balanced cost.

    Every index of ``lengths`` appears exactly once in the plan. A microbatch never holds more than
    ``max_tokens_per_microbatch`` tokens, except a single sample longer than that, which gets a microbatch of
    its own (or raises with ``allow_oversize=False``).

    - ``mode="odc"`` (LB-Mini): minimises the largest per-rank total cost (LPT greedy, then moves and swaps out
      of the most loaded rank until none helps), then packs each rank's samples into as few microbatches as the
      budget allows (first-fit decreasing on tokens). Ranks may get different numbers of microbatches; a rank
      gets no microbatch at all only when there are fewer samples than ranks.
    - ``mode="lockstep"`` (LB-Micro): every rank gets the same number of microbatches and slot k of every rank
      runs at the same time, so the planner minimises ``sum_k max_r cost(plan[r][k])``: it fills slots one at a
      time up to the level set by the costliest remaining sample while single samples dominate, spreads the rest
      over equal-cost microbatches (LPT), and then moves or swaps samples out of each slot's costliest microbatch.
      Within a slot, microbatches go to ranks so that the per-rank totals are balanced too. A microbatch is an
      empty list only where that cannot be avoided: when the step holds fewer samples than
      ``world_size * number_of_slots`` (e.g. fewer samples than ranks).

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
        mode (`"odc"` or `"lockstep"`, *optional*, defaults to `"odc"`):
            Balance per-rank totals (ODC) or every microbatch slot (plain FSDP2).
        model_config (`PretrainedConfig`, *optional*):
            Model configuration used by ``cost="auto"``.
        allow_oversize (`bool`, *optional*, defaults to `True`):
            Whether a sample longer than the budget may get a microbatch of its own. With `False` such a sample
            raises a `ValueError` (naming it) before any planning.

    Returns:
        `list[list[list[int]]]`: ``plan[r]`` is the list of microbatches of rank ``r``, each a list of indices
        into ``lengths``.
    """
    lengths_arr = _as_lengths(lengths)
    _check_plan_args(world_size, max_tokens_per_microbatch, mode)
    if not allow_oversize:
        check_oversize(lengths_arr, max_tokens_per_microbatch)
    costs = _check_costs(resolve_cost(cost, model_config)(lengths_arr))
    return plan_from_costs(costs, lengths_arr, world_size, max_tokens_per_microbatch, mode)


def _check_plan_args(world_size: int, max_tokens_per_microbatch: int, mode: str) -> None:
    if isinstance(world_size, bool) or int(world_size) != world_size or world_size < 1:
        raise ValueError(f"`world_size` must be a positive integer, got {world_size!r}.")
    if int(max_tokens_per_microbatch) != max_tokens_per_microbatch or max_tokens_per_microbatch <= 0:
        raise ValueError(
            f"`max_tokens_per_microbatch` must be a positive integer, got {max_tokens_per_microbatch!r}; "
            "set it to the most tokens one forward/backward can hold in memory."
        )
    if mode not in _MODES:
        raise ValueError(f"Unknown mode {mode!r}: use 'odc' (ODC engine) or 'lockstep' (plain FSDP2).")


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


def plan_from_costs(
    costs: np.ndarray,
    tokens: np.ndarray,
    world_size: int,
    max_tokens_per_microbatch: int,
    mode: Literal["odc", "lockstep"] = "odc",
) -> Plan:
    """`plan_step` on precomputed costs (no validation; the sampler computes costs once per dataset).

    Args:
        costs (`np.ndarray`): float64 cost of each sample.
        tokens (`np.ndarray`): int64 token count of each sample.
        world_size (`int`): number of ranks.
        max_tokens_per_microbatch (`int`): token budget of one microbatch.
        mode (`"odc"` or `"lockstep"`, *optional*, defaults to `"odc"`): planning mode.
    """
    costs = np.asarray(costs, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    n = costs.size
    if n == 0:
        return [[] for _ in range(world_size)]
    if mode == "odc" or world_size == 1:
        # On one rank nobody waits for anybody: both modes reduce to packing into as few microbatches as possible.
        return _plan_odc(costs, tokens, world_size, max_tokens_per_microbatch)
    return _plan_lockstep(costs, tokens, world_size, max_tokens_per_microbatch)


# --------------------------------------------------------------------------------------------------
# Metrics (used by the benchmark and the tests)
# --------------------------------------------------------------------------------------------------


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
        plan (`list[list[list[int]]]`): a plan as returned by `plan_step`.
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


# --------------------------------------------------------------------------------------------------
# Internals
# --------------------------------------------------------------------------------------------------


def _desc_order(costs: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    # Costliest first; ties by more tokens, then by index, so the plan never depends on sort stability.
    return np.lexsort((np.arange(costs.size), -tokens, -costs))


def _lpt(costs: np.ndarray, order: np.ndarray, n_bins: int) -> np.ndarray:
    """Longest-processing-time greedy: each item (costliest first) to the least loaded bin. Returns bin per item."""
    # Ties on load go to the bin with fewer items, so zero-cost samples still spread over the ranks.
    heap = [(0.0, 0, b) for b in range(n_bins)]
    bin_of = np.empty(costs.size, dtype=np.int64)
    for i in order.tolist():
        load, count, b = heapq.heappop(heap)
        bin_of[i] = b
        heapq.heappush(heap, (load + costs[i], count + 1, b))
    return bin_of


def _plan_odc(costs: np.ndarray, tokens: np.ndarray, world: int, budget: int) -> Plan:
    order = _desc_order(costs, tokens)
    rank_of = _lpt(costs, order, world)
    if world > 1:
        rank_of = _refine_totals(costs, rank_of, world)
    plan: Plan = []
    for r in range(world):
        members = np.flatnonzero(rank_of == r)
        plan.append(_pack_ffd(members, tokens, budget))
    return plan


def _pack_ffd(members: np.ndarray, tokens: np.ndarray, budget: int) -> list[list[int]]:
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


def _plan_lockstep(costs: np.ndarray, tokens: np.ndarray, world: int, budget: int) -> Plan:
    n = costs.size
    order = _desc_order(costs, tokens)
    oversize = tokens > budget
    remaining = order.tolist()
    slots: list[list[list[int]]] = []  # slots[k][j] = items of bin j of slot k (bins not yet tied to ranks)

    # Phase 1: while the costliest remaining sample costs more than the average slot level, the slot holding
    # it costs at least that much anyway, so fill every other microbatch of that slot up to the same level
    # ("free" work that later slots no longer have to carry).
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
    return _assign_slots_to_ranks(costs, tokens, bin_of, n_slots, world)


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
    """Local search on ``sum over slots of the costliest bin in the slot`` (one slot = ODC's ``max_r C_r``).

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


def _refine_totals(costs: np.ndarray, rank_of: np.ndarray, world: int, max_iters: int | None = None) -> np.ndarray:
    """`_refine` specialised to one slot without a token capacity (ODC's per-rank totals), with fewer array ops.

    With one slot and no capacity the best receiver of a single move is always the least loaded rank, so moves
    need no matrix; swaps are scored exactly as in `_refine`.
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


def _assign_slots_to_ranks(
    costs: np.ndarray, tokens: np.ndarray, bin_of: np.ndarray, n_slots: int, world: int
) -> Plan:
    """Hand the bins of each slot to ranks so that per-rank totals also come out balanced (costliest slot first)."""
    n_bins = n_slots * world
    members: list[list[int]] = [[] for _ in range(n_bins)]
    for i in _desc_order(costs, tokens).tolist():
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
