"""Models with recurrent layers (hybrid linear attention such as Qwen3.5 / Qwen3.6, Mamba hybrids, short
convolutions) and packed sequences.

A recurrent layer carries a state from token to token. Two samples packed in one row with ``position_ids`` alone
(what `transformers.DataCollatorWithFlattening` gives by default) are kept apart by full attention, not by such a
layer: the second sample then sees the first one's state. transformers keeps them apart only with the sequence
boundaries (``cu_seq_lens_q/k``, ``seq_idx``) and the kernels that read them (``flash-linear-attention`` for Gated
DeltaNet, ``mamba-ssm`` for Mamba, ``causal-conv1d`` for the short convolutions); without those kernels it raises on
the boundaries. So without them such a model trains on padded rows (one sample per row), which ODC plans by default.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from typing import Any

__all__ = [
    "RECURRENT_LAYER_TYPES",
    "is_hybrid",
    "layer_kinds",
    "missing_packing_kernels",
    "packing_refusal",
    "recurrent_model",
    "with_sequence_boundaries",
]

#: ``layer_types`` entries (transformers' ``ALLOWED_ATTN_LAYER_TYPES`` and the older names it remaps) of layers that
#: carry a state across tokens: Gated DeltaNet, KDA, Mamba and MiniMax lightning layers (``linear_attention``, legacy
#: ``mamba``), layers combining attention with such a state (``hybrid``, ``hybrid_sliding``: Zamba2, Falcon-H1), short
#: convolutions (``conv``: LFM2) and Griffin's ``recurrent`` blocks.
RECURRENT_LAYER_TYPES = frozenset(
    {"linear_attention", "mamba", "mamba2", "hybrid", "hybrid_sliding", "conv", "recurrent"}
)
#: Models made only of recurrent layers, whose configs list no layer types.
RECURRENT_MODEL_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"})
#: Where configs list their layers' kinds: ``layer_types`` (most), ``layers_block_type`` (Jamba, Bamba, Zamba),
#: ``block_types`` (RecurrentGemma: a pattern repeated over the layers).
_LAYER_FIELDS = ("layer_types", "layers_block_type", "block_types")
#: Import name -> distribution of the kernels that keep packed sequences apart in a recurrent layer.
_KERNELS = {"fla": "flash-linear-attention", "mamba_ssm": "mamba-ssm", "causal_conv1d": "causal-conv1d"}


def _config_of(model_or_config: Any) -> Any:
    unwrap = getattr(model_or_config, "get_base_model", None)
    model = unwrap() if callable(unwrap) else model_or_config
    config = getattr(model, "config", model)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _get(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def layer_kinds(model_or_config: Any) -> list[str] | None:
    """Each decoder layer's kind (``"full_attention"``, ``"linear_attention"``, ...) as the (text) config lists them,
    or `None` where it lists none."""
    config = _config_of(model_or_config)
    for field in _LAYER_FIELDS:
        kinds = _get(config, field)
        if kinds:
            kinds = [str(k) for k in kinds]
            layers = _get(config, "num_hidden_layers")
            if field == "block_types" and layers:  # RecurrentGemma repeats its pattern over the layers
                kinds = [kinds[i % len(kinds)] for i in range(int(layers))]
            return kinds
    return None


def recurrent_model(model_or_config: Any) -> bool:
    """Whether a model (or its config) has a layer that carries a state across tokens (see `RECURRENT_LAYER_TYPES`)."""
    config = _config_of(model_or_config)
    if _get(config, "model_type") in RECURRENT_MODEL_TYPES:
        return True
    return any(kind in RECURRENT_LAYER_TYPES for kind in layer_kinds(config) or ())


#: Models mixing recurrent and attention layers are the common case; the name says what the planner cares about.
is_hybrid = recurrent_model


def _needed_kernels(model: Any) -> list[str]:
    """The import names of the kernels transformers needs to keep packed sequences apart in ``model``: read from
    the kernel fallbacks its modeling module defines (Gated DeltaNet / KDA: ``fla``; Mamba: ``mamba_ssm``), plus the
    short convolution's ``causal_conv1d``, which every such module has."""
    unwrap = getattr(model, "get_base_model", None)
    model = unwrap() if callable(unwrap) else model
    module = sys.modules.get(type(model).__module__) if hasattr(model, "named_modules") else None
    names = " ".join(vars(module)) if module is not None and module.__name__.startswith("transformers.") else ""
    needed = []
    if "delta_rule" in names or "kda" in names or not names:
        needed.append("fla")  # a config alone (or a model outside transformers): the Qwen3.5 / 3.6 case
    if "mamba" in names or "selective_scan" in names:
        needed.append("mamba_ssm")
    return [*needed, "causal_conv1d"]


@functools.cache
def _installed(module: str) -> bool:
    # What transformers' kernel fallback decides on: whether the package imports (integrations/hub_kernels.py).
    return importlib.util.find_spec(module) is not None


def missing_packing_kernels(model: Any) -> list[str]:
    """The distributions (pip names) a recurrent ``model`` needs to train on packed sequences and that are not
    installed; empty when none is missing or the model has no recurrent layer."""
    if not recurrent_model(model):
        return []
    return [_KERNELS[name] for name in _needed_kernels(model) if not _installed(name)]


def packing_refusal(model: Any, setting: str, remedy: str) -> str | None:
    """The message refusing ``setting`` (what asked for packed sequences) for ``model``, or `None` when the model
    can train packed here; ``remedy`` says how to train padded instead."""
    missing = missing_packing_kernels(model)
    if not missing:
        return None
    kinds = sorted({k for k in layer_kinds(model) or () if k in RECURRENT_LAYER_TYPES}) or ["recurrent"]
    return (
        f"{setting} packs several samples into one row, but {type(_config_of(model)).__name__} has {', '.join(kinds)} "
        "layers, whose state would flow from one sample into the next; transformers keeps packed samples apart there "
        f"only with {' and '.join(missing)} installed (pip install {' '.join(missing)}; they need a GPU). Install "
        f"them, or train on padded rows: {remedy}."
    )


def with_sequence_boundaries(batch: dict) -> dict:
    """``batch`` (one packed row, ``position_ids`` restarting at 0 for each sample) with the boundaries transformers'
    recurrent kernels read: ``cu_seq_lens_q/k``, ``max_length_q/k`` and ``seq_idx``, computed as TRL 1.16's padding-free
    collator does. Boundaries already there are kept."""
    import torch

    if "seq_idx" in batch and "cu_seq_lens_q" in batch:
        return batch
    position_ids = batch["position_ids"]
    starts = (position_ids[0] == 0).nonzero().flatten()
    cu = torch.cat([starts, torch.tensor([position_ids.size(1)])]).to(torch.int32)
    out = dict(batch)
    out.setdefault("cu_seq_lens_q", cu)
    out.setdefault("cu_seq_lens_k", cu)
    out.setdefault("max_length_q", int(cu.diff().max()))
    out.setdefault("max_length_k", int(cu.diff().max()))
    out.setdefault(
        "seq_idx", torch.repeat_interleave(torch.arange(cu.numel() - 1, dtype=torch.int32), cu.diff())[None]
    )
    return out
