"""PEFT LoRA adapters merged into the weights of the model they wrap, one layer at a time, as PEFT merges them.

A generation engine (vLLM) serves the plain model, so the weights it gets from a LoRA model trained with ODC are
``base + B @ A * scaling`` per adapted layer, under the wrapped model's names: what PEFT's ``merge_and_unload``
gives. `lora_layers` reads, from the model alone, how each adapted layer merges, and refuses (before any engine is
built) every adapter whose merge is not that plain rule: PEFT's LoRA variants (``lora_variant``: DoRA, aLoRA, Arrow,
QALoRA, ... each merges by its own rule), LoRA on convolutions, embeddings or bare parameters (``target_parameters``),
quantized base layers, a LoRA bias, several active adapters, an adapter already merged and ``modules_to_save``.
`LoraMerge` then turns the stream of the model's full parameters into the merged weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = ["PEFT_PREFIX", "LoraLayer", "LoraMerge", "base_model_of", "has_adapters", "lora_layers"]

#: What PEFT puts before the wrapped model's own parameter names.
PEFT_PREFIX = "base_model.model."
# Parameter names of a LoRA-wrapped linear layer (`LoraMerge` merges them).
_ADAPTER_MARKERS = (".lora_A.", ".lora_B.", ".base_layer.")
# Parameter names of PEFT modules whose weights do not merge into the wrapped model by the LoRA rule.
_UNMERGEABLE_MARKERS = {
    ".lora_embedding_A": "LoRA on an embedding",
    ".lora_embedding_B": "LoRA on an embedding",
    ".modules_to_save.": "modules_to_save (a trained copy of a whole module)",
    ".original_module.": "modules_to_save (a trained copy of a whole module)",
}


@dataclass(frozen=True)
class LoraLayer:
    """How one LoRA-wrapped linear layer merges (PEFT's ``get_delta_weight``: ``transpose(B @ A, fan_in_fan_out) *
    scaling``).

    Attributes:
        adapter (`str`): the active adapter's name.
        scaling (`float`): its ``lora_alpha / r`` (or ``/ sqrt(r)`` with rsLoRA).
        fan_in_fan_out (`bool`): the base layer stores its weight transposed (GPT-2's ``Conv1D``).
    """

    adapter: str
    scaling: float
    fan_in_fan_out: bool


def has_adapters(names: list[str]) -> bool:
    """Whether parameter ``names`` include PEFT adapter or ``modules_to_save`` tensors."""
    markers = (*_ADAPTER_MARKERS, *_UNMERGEABLE_MARKERS)
    return any(marker in name for name in names for marker in markers)


def _plain_linear_class() -> type | None:
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # no PEFT installed: no model can carry its layers
        return None
    return Linear


def lora_layers(model: nn.Module) -> dict[str, LoraLayer]:
    """The LoRA-wrapped linear layers of ``model`` by name prefix (``"...q_proj."``), each with its active adapter.

    Args:
        model (`torch.nn.Module`): the model, PEFT-wrapped or not (then the result is empty).

    Raises:
        NotImplementedError: a PEFT module whose weights do not merge by the plain LoRA rule, named with what to
            change: a LoRA variant (``lora_variant``, DoRA included), LoRA on a convolution, an embedding or a bare
            parameter, a quantized or otherwise non-``torch.nn.Linear`` base layer, a LoRA bias, several active
            adapters, an adapter already merged, or ``modules_to_save``.
    """
    advice = "train plain LoRA on linear layers (or generate without vLLM)"
    for name, _ in model.named_parameters():
        for marker, what in _UNMERGEABLE_MARKERS.items():
            if marker in name:
                raise NotImplementedError(
                    f"{name}: the model carries {what}, which the vLLM weight sync cannot merge into the served "
                    f"model; {advice}."
                )
    plain = _plain_linear_class()
    layers: dict[str, LoraLayer] = {}
    for name, module in model.named_modules():
        if not (hasattr(module, "lora_A") and hasattr(module, "base_layer") and hasattr(module, "scaling")):
            continue
        where = name or type(module).__name__
        kind = f"{type(module).__module__}.{type(module).__qualname__}"
        if plain is None or type(module) is not plain:
            raise NotImplementedError(
                f"{where} is a PEFT {kind} layer; the vLLM weight sync merges LoRA on torch.nn.Linear layers only "
                f"(peft.tuners.lora.layer.Linear), not on convolutions, embeddings, bare parameters "
                f"(target_parameters) or quantized layers; {advice}."
            )
        active = list(getattr(module, "active_adapters", []))
        if len(active) != 1:
            raise NotImplementedError(f"{where} has {len(active)} active LoRA adapters; the vLLM sync merges one")
        adapter = active[0]
        if getattr(module, "merged", False):
            raise NotImplementedError(f"{where}: its adapter is merged already; unmerge it (or train without merging)")
        if getattr(module, "use_dora", {}).get(adapter, False):
            raise NotImplementedError(f"{where} uses DoRA; the vLLM weight sync merges plain LoRA adapters only")
        variant = getattr(module, "lora_variant", {}).get(adapter)
        if variant is not None:
            raise NotImplementedError(
                f"{where}: adapter {adapter!r} is the LoRA variant {type(variant).__name__}, which PEFT merges by its "
                f"own rule; the vLLM weight sync merges plain LoRA adapters only; {advice}."
            )
        if adapter not in module.lora_A or not isinstance(module.base_layer, nn.Linear):
            raise NotImplementedError(
                f"{where}: LoRA on {type(module.base_layer).__name__} is not supported by the vLLM weight sync; "
                f"{advice}."
            )
        if module.lora_B[adapter].bias is not None:
            raise NotImplementedError(
                f"{where} has a LoRA bias (lora_bias=True); the vLLM weight sync does not merge it"
            )
        layers[f"{name}." if name else ""] = LoraLayer(
            adapter, float(module.scaling[adapter]), bool(getattr(module, "fan_in_fan_out", False))
        )
    return layers


class LoraMerge:
    """Turns a PEFT LoRA model's parameters into the merged weights of the model it wraps, under that model's names.

    Fed each (name, full tensor) in turn: ``base_layer.bias`` passes under the layer's own name; a layer's
    ``base_layer.weight``, ``lora_A.<adapter>.weight`` and ``lora_B.<adapter>.weight`` are held until all three are
    there, then ``base + transpose(B @ A, fan_in_fan_out) * scaling`` goes out as the layer's ``weight`` (PEFT's own
    merge: the same operations in the same order, so the result equals ``merge_and_unload()`` bit for bit); other
    adapters' tensors are dropped. A layer's three tensors are in one FSDP unit unless the wrapping split them, so
    at most one unit's LoRA layers are held. Names keep PEFT's ``base_model.model.`` prefix; the caller strips it.

    Args:
        layers (`dict[str, LoraLayer]`): the model's adapted layers, from `lora_layers`.
    """

    def __init__(self, layers: dict[str, LoraLayer]):
        self.layers = layers
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def feed(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The merged weights that ``name`` completes (none while a layer still misses a part)."""
        for marker, part in ((".base_layer.", "base"), (".lora_A.", "A"), (".lora_B.", "B")):
            cut = name.find(marker)
            if cut < 0:
                continue
            prefix, rest = name[: cut + 1], name[cut + len(marker) :]
            layer = self.layers.get(prefix)
            if layer is None:
                raise NotImplementedError(f"{name}: a PEFT adapter layer the vLLM sync does not know how to merge")
            if part == "base":
                if rest != "weight":
                    return [(prefix + rest, tensor)]  # the bias, and any other tensor of the wrapped layer
            elif rest != f"{layer.adapter}.weight":
                return []  # an inactive adapter
            held = self.pending.setdefault(prefix, {})
            held[part] = tensor
            if len(held) < 3:
                return []
            del self.pending[prefix]
            return [(prefix + "weight", _merged(held["base"], held["A"], held["B"], layer))]
        return [(name, tensor)]

    def finish(self) -> None:
        """Raise if a layer got only some of its base weight, A and B."""
        if self.pending:
            prefix, held = next(iter(self.pending.items()))
            raise RuntimeError(f"LoRA layer {prefix}: got only {sorted(held)} of its base weight, A and B")


def _merged(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, layer: LoraLayer) -> torch.Tensor:
    # As PEFT: half precision on CPU is multiplied in fp32 (slow half-precision matmuls there), then cast back.
    low = b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
    delta = b.float() @ a.float() if low else b @ a
    if layer.fan_in_fan_out:
        delta = delta.T
    delta = delta * layer.scaling
    return base.add_(delta.to(b.dtype) if low else delta)


def base_model_of(model: Any) -> Any:
    """The model a PEFT model wraps (``model`` itself when it is not one)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model
