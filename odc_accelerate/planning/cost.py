"""Cost models: the training cost of one sequence as a function of its length.

Only ratios of costs matter to the planners, so the unit (FLOPs, seconds, arbitrary) is free.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..validation import check_positive_int

logger = logging.getLogger(__name__)

__all__ = [
    "PUBLISHED_1_5B_COST",
    "PUBLISHED_7B_COST",
    "CostSpec",
    "QuadraticCost",
    "check_costs",
    "cost_from_config",
    "flops_cost",
    "resolve_cost",
]

CostSpec = Literal["auto", "tokens"] | Callable[[int], float]


@dataclass(frozen=True)
class QuadraticCost:
    """Per-sequence training cost ``linear * L + quadratic * L**2`` for a sequence of ``L`` tokens, plus a term per
    attention window (sliding-window layers).

    Instances are callables that accept a length or an array of lengths (vectorised with numpy).
    Only ratios of costs matter to the planner, so the unit (FLOPs, seconds, arbitrary) is free.

    Args:
        linear (`float`):
            Cost per token (linear layers, LM head, linear-attention layers).
        quadratic (`float`):
            Cost per squared token (attention scores ``QK^T`` and ``AV`` of the full-attention layers).
        windows (`tuple[tuple[int, float], ...]`, *optional*):
            ``(window, coefficient)`` pairs of sliding-window layers: each adds ``coefficient * L**2`` up to the
            window and ``coefficient * (2 * window * L - window**2)`` beyond it (a query sees at most ``window``
            keys), continuous at the window.
    """

    linear: float
    quadratic: float
    windows: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        coefficients = [self.linear, self.quadratic, *(c for _, c in self.windows)]
        if not all(math.isfinite(c) and c >= 0 for c in coefficients) or any(w < 1 for w, _ in self.windows):
            raise ValueError(
                f"QuadraticCost needs finite, non-negative coefficients and windows >= 1, got linear={self.linear}, "
                f"quadratic={self.quadratic}, windows={self.windows}."
            )
        if not any(coefficients):
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
        for window, coefficient in self.windows:
            out = out + coefficient * np.where(arr <= window, arr * arr, 2.0 * window * arr - float(window) ** 2)
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
    layer_types: Sequence[str] | None = None,
    sliding_window: int | None = None,
    linear_attention_flops: float | None = None,
) -> QuadraticCost:
    """Training FLOPs of one sequence for a decoder-only transformer, as a `QuadraticCost`.

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

    Layer kinds (``layer_types``, one per layer, as transformers configs list them; all full attention without it):
    a ``sliding_attention`` / ``chunked_attention`` layer has the attention projections and its score term up to
    ``sliding_window`` (`QuadraticCost.windows`); a recurrent layer (``linear_attention``, ``mamba``, ``conv``, ...:
    `odc_accelerate.hybrid.RECURRENT_LAYER_TYPES`) has no term in ``L^2`` and costs ``linear_attention_flops`` per
    token (forward; default: the attention projections'). Every layer has the MLP.

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
        layer_types (`Sequence[str]`, *optional*): each layer's kind, ``num_layers`` of them.
        sliding_window (`int`, *optional*): the window of the sliding-window layers (needed when there are any).
        linear_attention_flops (`float`, *optional*): forward FLOPs per token of one recurrent layer's token mixing
            (its projections and recurrence, the MLP apart).
    """
    from ..hybrid import RECURRENT_LAYER_TYPES

    num_layers = check_positive_int(num_layers, "flops_cost: `num_layers`")
    hidden_size = check_positive_int(hidden_size, "flops_cost: `hidden_size`")
    intermediate_size = check_positive_int(intermediate_size, "flops_cost: `intermediate_size`")
    num_attention_heads = check_positive_int(num_attention_heads, "flops_cost: `num_attention_heads`")
    if vocab_size < 0:
        raise ValueError(f"flops_cost needs `vocab_size >= 0`, got {vocab_size}.")
    kv_heads = num_attention_heads
    if num_key_value_heads is not None:
        kv_heads = check_positive_int(num_key_value_heads, "flops_cost: `num_key_value_heads`")
    if head_dim is None:
        head_dim = hidden_size // num_attention_heads
    head_dim = check_positive_int(head_dim, "flops_cost: `head_dim`")
    d_q = num_attention_heads * head_dim
    d_kv = kv_heads * head_dim
    h = hidden_size
    kinds = ["full_attention"] * num_layers if layer_types is None else [str(k) for k in layer_types]
    if len(kinds) != num_layers:
        raise ValueError(f"flops_cost: {len(kinds)} `layer_types` for {num_layers} layers; give one per layer.")
    recurrent = sum(k in RECURRENT_LAYER_TYPES for k in kinds)
    sliding = sum(k in _WINDOWED_LAYER_TYPES for k in kinds)
    if sliding and not sliding_window:
        raise ValueError("flops_cost: `layer_types` has sliding-window layers; pass their `sliding_window`.")
    attention_projections = 2 * h * d_q + 2 * 2 * h * d_kv + 2 * d_q * h
    mixing = attention_projections if linear_attention_flops is None else float(linear_attention_flops)
    mlp = (3 if gated_mlp else 2) * 2 * h * intermediate_size
    per_layer = num_layers * mlp + (num_layers - recurrent) * attention_projections + recurrent * mixing
    passes = 3 if backward else 1
    linear = passes * (per_layer + 2 * h * vocab_size)
    per_attention_layer = passes * (2 if causal else 4) * d_q
    quadratic = per_attention_layer * (num_layers - recurrent - sliding)
    windows = ((int(sliding_window), float(per_attention_layer * sliding)),) if sliding else ()
    return QuadraticCost(linear=float(linear), quadratic=float(quadratic), windows=windows)


#: Layer kinds whose attention sees at most ``sliding_window`` keys per query (``chunked_attention``: at most a chunk).
_WINDOWED_LAYER_TYPES = frozenset({"sliding_attention", "chunked_attention", "hybrid_sliding"})
#: Gated DeltaNet's chunk length (transformers' ``chunk_gated_delta_rule`` and flash-linear-attention's): its
#: intra-chunk products cost like attention over a window of one chunk.
_DELTA_RULE_CHUNK = 64


def _linear_attention_flops(get: Callable[..., Any], hidden: int) -> float | None:
    """Forward FLOPs per token of one Gated DeltaNet layer (Qwen3.5 / Qwen3.6, Qwen3-Next) from its config fields, or
    `None` for another recurrent layer: the projections (q, k, v, the gate z, the decay and beta heads, the output),
    the short convolution, and the chunked delta rule per value head: ``2 C (d_k + d_v)`` of intra-chunk products
    (chunks of ``C`` = 64 tokens) and ``6 d_k d_v`` of state reads and updates."""
    value_heads = get("linear_num_value_heads")
    key_heads = get("linear_num_key_heads")
    key_dim, value_dim = get("linear_key_head_dim"), get("linear_value_head_dim")
    if not (value_heads and key_heads and key_dim and value_dim):
        return None
    keys, values = key_heads * key_dim, value_heads * value_dim
    kernel = get("linear_conv_kernel_dim") or 4
    projections = 2 * hidden * (2 * keys + values) + 2 * hidden * values + 2 * 2 * hidden * value_heads
    projections += 2 * values * hidden
    conv = 2 * kernel * (2 * keys + values)
    rule = value_heads * (2 * _DELTA_RULE_CHUNK * (key_dim + value_dim) + 6 * key_dim * value_dim)
    return float(projections + conv + rule)


# model_type values whose MLP is a plain up/act/down (no gate projection).
_UNGATED_MODEL_TYPES = frozenset(
    {"gpt2", "gpt_neox", "gptj", "gpt_bigcode", "opt", "bloom", "falcon", "phi", "starcoder2", "bert", "roberta"}
)


def cost_from_config(config: Any, causal: bool = True, gated_mlp: bool | None = None) -> QuadraticCost:
    """Model-derived training cost (see `flops_cost`) from a transformers config or any object with its fields.

    Reads Llama-style names (``num_hidden_layers``, ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim``, ``vocab_size``) and falls back to GPT-2 names (``n_layer``, ``n_embd``,
    ``n_inner``, ``n_head``). Multimodal configs use their text config. The layers' kinds come from ``layer_types``
    (`odc_accelerate.hybrid.layer_kinds`): the ``L^2`` term is charged on full-attention layers only, sliding-window
    layers up to ``sliding_window``, and recurrent layers (Gated DeltaNet, Mamba) have none. For mixture-of-experts
    configs (with
    ``num_experts_per_tok``) the MLP counts the active experts, each ``moe_intermediate_size`` wide (Qwen-MoE,
    DeepSeek) or, without it, ``intermediate_size`` wide (Mixtral, OLMoE, GPT-OSS), plus the shared experts
    (``shared_expert_intermediate_size`` wide, or ``n_shared_experts`` experts). A config with 0 experts is dense.

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
    experts = first("num_experts", "num_local_experts", "n_routed_experts")
    if experts_per_tok and experts != 0:
        # Each token runs its top-k experts. Qwen-MoE and DeepSeek name one expert's width moe_intermediate_size
        # (intermediate_size is their dense MLP's); Mixtral, OLMoE and GPT-OSS have none, and their intermediate_size
        # is one expert's width. Shared experts run for every token: Qwen2-MoE gives their width, DeepSeek a count.
        expert = get("moe_intermediate_size") or intermediate
        shared = (get("shared_expert_intermediate_size") or 0) + (get("n_shared_experts") or 0) * expert
        intermediate = experts_per_tok * expert + shared
    if gated_mlp is None:
        gated_mlp = get("model_type") not in _UNGATED_MODEL_TYPES
    from ..hybrid import layer_kinds

    kinds = layer_kinds(config)
    if kinds is not None and len(kinds) != int(layers):
        kinds = None  # a config listing another count (e.g. with extra prediction layers): all full attention
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
        layer_types=kinds,
        sliding_window=get("sliding_window") or get("attention_chunk_size"),
        linear_attention_flops=_linear_attention_flops(get, int(hidden)),
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


def check_costs(costs: np.ndarray) -> np.ndarray:
    """``costs`` as a float64 array, or a `ValueError` naming the first sample whose cost is negative or not finite.

    Args:
        costs (`np.ndarray`): what a cost function returned for each sample.
    """
    costs = np.asarray(costs, dtype=np.float64)
    if costs.size and not (np.all(np.isfinite(costs)) and costs.min() >= 0):
        bad = int(np.flatnonzero(~np.isfinite(costs) | (costs < 0))[0])
        raise ValueError(f"The cost function returned {costs[bad]} for sample {bad}; costs must be finite and >= 0.")
    return costs
