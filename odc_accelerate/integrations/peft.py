"""PEFT adapters merged into the weights of the model they wrap, one layer at a time, as PEFT's ``merge_and_unload``
merges them.

A generation engine (vLLM) serves the plain model, so the weights it gets from a PEFT model trained with ODC are what
``merge_and_unload`` gives, under the wrapped model's names: per LoRA layer ``base + B @ A * scaling`` (with DoRA,
that rescaled per output row by its magnitude vector; with a LoRA bias, ``bias + B.bias * scaling``), and per
``modules_to_save`` module its trained copy. `sync_merge` reads from the model alone how each layer merges and
refuses, before any engine is built and by name, what PEFT cannot merge or merges by a rule not applied here: the
other LoRA variants (``lora_variant``: aLoRA, Arrow, QALoRA, ...), LoRA on convolutions, embeddings or bare parameters
(``target_parameters``), quantized base layers, a LoRA bias on a layer without a bias, trainable tokens, several active
adapters, an adapter already merged, replicated layers, and weights that the adapters untie. `LoraMerge` then turns
the stream of the model's full parameters into the merged weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

__all__ = [
    "PEFT_PREFIX",
    "LoraLayer",
    "LoraMerge",
    "base_model_of",
    "has_adapters",
    "lora_layers",
    "saved_modules",
    "sync_merge",
]

#: What PEFT puts before the wrapped model's own parameter names.
PEFT_PREFIX = "base_model.model."
# Parameter names of a LoRA-wrapped linear layer (`LoraMerge` merges them).
_ADAPTER_MARKERS = (".lora_A.", ".lora_B.", ".lora_magnitude_vector.", ".base_layer.")
# Parameter names of a ModulesToSaveWrapper: the frozen original and the trained copies, one per adapter.
_ORIGINAL, _COPIES = ".original_module.", ".modules_to_save."
# Parameter names of PEFT modules whose weights the sync does not merge.
_UNMERGEABLE_MARKERS = {
    ".lora_embedding_A": "LoRA on an embedding",
    ".lora_embedding_B": "LoRA on an embedding",
    ".token_adapter.": "trainable tokens (trainable_token_indices)",
}
_ADVICE = "train LoRA (plain, DoRA or with lora_bias) on linear layers, or generate without vLLM"


@dataclass(frozen=True)
class LoraLayer:
    """How one LoRA-wrapped linear layer merges (PEFT's ``Linear.merge``).

    Attributes:
        adapter (`str`): the active adapter's name.
        scaling (`float`): its ``lora_alpha / r`` (or ``/ sqrt(r)`` with rsLoRA).
        fan_in_fan_out (`bool`): the base layer stores its weight transposed (GPT-2's ``Conv1D``).
        dora (`bool`): DoRA (``use_dora``): the merged weight is rescaled by ``lora_magnitude_vector``.
        bias (`bool`): a LoRA bias (``lora_bias``): ``lora_B``'s bias merges into the base layer's.
    """

    adapter: str
    scaling: float
    fan_in_fan_out: bool
    dora: bool = False
    bias: bool = False

    def parts(self) -> dict[str, tuple[str, ...]]:
        """Per merged tensor of the layer (``weight``, ``bias``), the layer's tensors it is made of."""
        a = self.adapter
        weight = ("base_layer.weight", f"lora_A.{a}.weight", f"lora_B.{a}.weight")
        merged = {"weight": (*weight, f"lora_magnitude_vector.{a}.weight") if self.dora else weight}
        if self.bias:
            merged["bias"] = ("base_layer.bias", f"lora_B.{a}.bias")
        return merged


def has_adapters(names: list[str]) -> bool:
    """Whether parameter ``names`` include PEFT adapter or ``modules_to_save`` tensors."""
    markers = (*_ADAPTER_MARKERS, _ORIGINAL, _COPIES, *_UNMERGEABLE_MARKERS)
    return any(marker in name for name in names for marker in markers)


def _plain_linear_class() -> tuple[type, type] | None:
    try:
        from peft.tuners.lora.layer import Linear
        from peft.tuners.lora.variants import DoraLinearVariant
    except ImportError:  # no PEFT installed: no model can carry its layers
        return None
    return Linear, DoraLinearVariant


def lora_layers(model: nn.Module) -> dict[str, LoraLayer]:
    """The LoRA-wrapped linear layers of ``model`` by name prefix (``"...q_proj."``), each with its active adapter.

    Args:
        model (`torch.nn.Module`): the model, PEFT-wrapped or not (then the result is empty).

    Raises:
        NotImplementedError: a PEFT module whose weights the sync does not merge, named with what to change: a LoRA
            variant other than DoRA (``lora_variant``), LoRA on a convolution, an embedding or a bare parameter, a
            quantized or otherwise non-``torch.nn.Linear`` base layer, a LoRA bias on a layer without a bias, trainable
            tokens, several active adapters or an adapter already merged.
    """
    for name, _ in model.named_parameters():
        for marker, what in _UNMERGEABLE_MARKERS.items():
            if marker in name:
                raise NotImplementedError(
                    f"{name}: the model carries {what}, which the vLLM weight sync cannot merge into the served "
                    f"model; {_ADVICE}."
                )
    classes = _plain_linear_class()
    layers: dict[str, LoraLayer] = {}
    for name, module in model.named_modules():
        if not (hasattr(module, "lora_A") and hasattr(module, "base_layer") and hasattr(module, "scaling")):
            continue
        where = name or type(module).__name__
        kind = f"{type(module).__module__}.{type(module).__qualname__}"
        if classes is None or type(module) is not classes[0]:
            raise NotImplementedError(
                f"{where} is a PEFT {kind} layer; the vLLM weight sync merges LoRA on torch.nn.Linear layers only "
                f"(peft.tuners.lora.layer.Linear), not on convolutions, embeddings, bare parameters "
                f"(target_parameters) or quantized layers; {_ADVICE}."
            )
        active = list(getattr(module, "active_adapters", []))
        if len(active) != 1:
            raise NotImplementedError(f"{where} has {len(active)} active LoRA adapters; the vLLM sync merges one")
        adapter = active[0]
        if getattr(module, "merged", False):
            raise NotImplementedError(f"{where}: its adapter is merged already; unmerge it (or train without merging)")
        variant = getattr(module, "lora_variant", {}).get(adapter)
        if variant is not None and type(variant) is not classes[1]:
            raise NotImplementedError(
                f"{where}: adapter {adapter!r} is the LoRA variant {type(variant).__name__}, which PEFT merges by its "
                f"own rule (or not at all); the vLLM weight sync merges plain LoRA and DoRA; {_ADVICE}."
            )
        if adapter not in module.lora_A or not isinstance(module.base_layer, nn.Linear):
            raise NotImplementedError(
                f"{where}: LoRA on {type(module.base_layer).__name__} is not supported by the vLLM weight sync; "
                f"{_ADVICE}."
            )
        bias = module.lora_B[adapter].bias is not None
        if bias and module.base_layer.bias is None:
            raise NotImplementedError(
                f"{where} has a LoRA bias (lora_bias=True) but its base layer has none, which PEFT cannot merge; "
                f"set lora_bias=False or target only layers with a bias."
            )
        layers[f"{name}." if name else ""] = LoraLayer(
            adapter,
            float(module.scaling[adapter]),
            bool(getattr(module, "fan_in_fan_out", False)),
            dora=variant is not None,
            bias=bias,
        )
    return layers


def saved_modules(model: nn.Module) -> dict[str, str | None]:
    """The ``modules_to_save`` wrappers of ``model`` by name prefix (``"lm_head."``), each with the adapter whose
    trained copy the merged model gets (None: none is active, the original stays, as in PEFT's unload)."""
    saved: dict[str, str | None] = {}
    for name, module in model.named_modules():
        if not (
            hasattr(module, "original_module") and isinstance(getattr(module, "modules_to_save", None), nn.ModuleDict)
        ):
            continue
        active = [a for a in getattr(module, "active_adapters", []) if a in module.modules_to_save]
        if len(active) > 1:
            raise NotImplementedError(f"{name} has {len(active)} active modules_to_save copies; PEFT merges one")
        if active and any(hasattr(m, "lora_A") for m in module.modules_to_save[active[0]].modules()):
            raise NotImplementedError(f"{name}: its modules_to_save copy carries LoRA layers; {_ADVICE}.")
        saved[f"{name}."] = active[0] if active else None
    return saved


@dataclass
class LoraMerge:
    """Turns a PEFT model's parameters into the merged weights of the model it wraps, under that model's names.

    Fed each (name, full tensor) in turn. A ``modules_to_save`` wrapper's active copy passes under the module's own
    name, its original and other copies are dropped (PEFT's unload). A LoRA layer's ``base_layer`` tensors pass under
    the layer's own names, except those it merges (`LoraLayer.parts`): they are held until all their parts are there,
    then go out merged by PEFT's own operations in PEFT's order, so the result equals ``merge_and_unload()`` bit for
    bit; other adapters' tensors are dropped. A layer's tensors are in one FSDP unit unless the wrapping split them, so
    at most one unit's LoRA layers are held. Names keep PEFT's ``base_model.model.`` prefix; the caller strips it.

    Args:
        layers (`dict[str, LoraLayer]`): the model's adapted layers, from `lora_layers`.
        saved (`dict[str, str | None]`): its ``modules_to_save`` wrappers, from `saved_modules`.
    """

    layers: dict[str, LoraLayer]
    saved: dict[str, str | None] = field(default_factory=dict)
    pending: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def route(self, name: str) -> tuple[str, str | None] | None:
        """Where the tensor ``name`` goes: None when the merged model drops it, else the name it goes out under and,
        when it is a part of a merged tensor (`LoraLayer.parts`), which part (None: it goes out as it is)."""
        for marker in (_ORIGINAL, _COPIES):
            cut = name.find(marker)
            if cut >= 0 and name[: cut + 1] in self.saved:
                prefix, rest = name[: cut + 1], name[cut + len(marker) :]
                active = self.saved[prefix]
                if marker == _ORIGINAL:
                    return None if active is not None else (prefix + rest, None)
                adapter, _, rest = rest.partition(".")
                return (prefix + rest, None) if adapter == active else None
        for marker in _ADAPTER_MARKERS:
            cut = name.find(marker)
            if cut < 0:
                continue
            prefix, rest = name[: cut + 1], name[cut + 1 :]
            layer = self.layers.get(prefix)
            if layer is None:
                raise NotImplementedError(f"{name}: a PEFT adapter layer the vLLM sync does not know how to merge")
            for out, parts in layer.parts().items():
                if rest in parts:
                    return prefix + out, rest
            if rest.startswith("base_layer."):
                return prefix + rest[len("base_layer.") :], None  # a base tensor the adapter leaves alone
            if rest.split(".")[1] != layer.adapter:
                return None  # an inactive adapter
            raise NotImplementedError(f"{name}: a tensor of a PEFT adapter the vLLM sync does not know how to merge")
        return name, None

    def served_name(self, name: str) -> str | None:
        """The name an unmerged tensor (a tied weight's other name) goes out under; None when it is dropped."""
        route = self.route(name)
        return route[0] if route is not None and route[1] is None else None

    def feed(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The tensors that ``name`` completes (none while a merged tensor still misses a part)."""
        route = self.route(name)
        if route is None:
            return []
        out, part = route
        if part is None:
            return [(out, tensor)]
        prefix, kind = out[: out.rfind(".") + 1], out[out.rfind(".") + 1 :]
        layer = self.layers[prefix]
        parts = layer.parts()[kind]
        held = self.pending.setdefault(out, {})
        held[part] = tensor
        if len(held) < len(parts):
            return []
        del self.pending[out]
        return [(out, _merged(kind, [held[p] for p in parts], layer))]

    def finish(self) -> None:
        """Raise if a merged tensor got only some of its parts."""
        if self.pending:
            name, held = next(iter(self.pending.items()))
            raise RuntimeError(f"LoRA tensor {name}: got only {sorted(held)} of its parts")


def _transpose(tensor: torch.Tensor, fan_in_fan_out: bool) -> torch.Tensor:
    return tensor.T if fan_in_fan_out else tensor  # peft.utils.other.transpose


def _merged(kind: str, parts: list[torch.Tensor], layer: LoraLayer) -> torch.Tensor:
    """PEFT's ``Linear.merge`` (unsafe, the default of ``merge_and_unload``) of one tensor, in PEFT's operations."""
    if kind == "bias":
        base, lora_bias = parts
        return base.add_(lora_bias * layer.scaling)
    base, a, b, *magnitude = parts
    # get_delta_weight: half precision on CPU is multiplied in fp32 (slow half-precision matmuls there), cast back
    low = b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
    delta = _transpose(b.float() @ a.float() if low else b @ a, layer.fan_in_fan_out) * layer.scaling
    if low:
        delta = delta.to(b.dtype)
    if not magnitude:
        return base.add_(delta)
    # DoRA (DoraLinearVariant.merge_unsafe): the norm per output row of the unmerged weight plus the delta
    # (get_weight_norm with scaling 1), the magnitude over it, times the merged weight
    weight = _transpose(base, layer.fan_in_fan_out) + _transpose(delta, layer.fan_in_fan_out)
    norm = torch.linalg.norm(weight, dim=1).to(weight.dtype)
    factor = _transpose((magnitude[0] / norm).view(-1, 1), layer.fan_in_fan_out)
    return (factor * (base + delta)).to(base.dtype)


def _check_ties(model: nn.Module, merge: LoraMerge) -> None:
    """Refuse a weight tied in the wrapped model that the merged model would serve apart (or the reverse): vLLM ties
    what the wrapped model's config ties, so the trained copy of one of them would be lost. PEFT's
    ``ensure_weight_tying=True`` keeps one tied copy of a tied embedding and LM head in ``modules_to_save``."""
    before: dict[str, int] = {}  # the wrapped model's names -> its tensors
    after: dict[str, Any] = {}  # the merged model's names -> what goes out under them
    for name, param in model.named_parameters(remove_duplicate=False):
        if not any(marker in name for marker in (_COPIES, ".lora_A.", ".lora_B.", ".lora_magnitude_vector.")):
            before[name.replace(_ORIGINAL, ".").replace(".base_layer.", ".")] = id(param)
        route = merge.route(name)
        if route is not None:
            after[route[0]] = route[0] if route[1] is not None else id(param)

    def groups(names: dict[str, Any]) -> dict[Any, set[str]]:
        out: dict[Any, set[str]] = {}
        for name, key in names.items():
            out.setdefault(key, set()).add(name)
        return out

    was_tied, now_tied = groups(before), groups(after)
    for name, key in before.items():
        was, now = was_tied[key], now_tied[after[name]] if name in after else set()
        if (len(was) > 1 or len(now) > 1) and was != now:
            raise NotImplementedError(
                f"{name}: tied to {sorted(was - {name})} in the wrapped model, to {sorted(now - {name})} once the "
                "adapters are merged (a modules_to_save copy or a LoRA layer of only one of the tied modules), so "
                "the served model, which ties them, would lose a trained weight; set ensure_weight_tying=True in the "
                "LoraConfig (one tied copy of the embedding and LM head), or adapt neither of them."
            )


def sync_merge(model: nn.Module) -> LoraMerge:
    """How the vLLM sync merges ``model``'s PEFT adapters (`LoraMerge`), checked from the model alone.

    Raises:
        NotImplementedError: what the sync does not merge (see `lora_layers`), several active ``modules_to_save``
            copies, replicated layers (``layer_replication``, which PEFT cannot merge), weights the adapters untie.
    """
    for config in (getattr(model, "peft_config", None) or {}).values():
        if getattr(config, "layer_replication", None):
            raise NotImplementedError(
                f"{PEFT_PREFIX}: the LoraConfig has layer_replication, whose layers PEFT cannot merge; train without it "
                "(or generate without vLLM)."
            )
    merge = LoraMerge(lora_layers(model), saved_modules(model))
    _check_ties(model, merge)
    return merge


def base_model_of(model: Any) -> Any:
    """The model a PEFT model wraps (``model`` itself when it is not one)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model
