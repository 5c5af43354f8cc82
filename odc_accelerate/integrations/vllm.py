"""Refresh a vLLM engine's weights from a model trained with ODC, with no torch.distributed call.

Under FSDP2, refreshing a generation engine with the trained weights means gathering the full model with collectives
(TRL's colocate mode does one per parameter): every rank must be there. Under ODC each rank publishes its shards in a
transport buffer that any peer may read at any time between optimizer steps, so each rank can refresh its own engine
by itself: `iter_full_parameters` unshards the model one FSDP unit at a time through FSDP2's own unshard, whose
all-gather is ODC's hook (one transport read per peer shard, the path every ODC forward takes), and yields each
parameter under its Hugging Face name; `sync_vllm_weights` feeds those to vLLM's in-place reload
(``worker.reload_weights``), which loads and repacks each layer. No rank waits for another, and nothing beyond one
FSDP unit is held in full outside the engine's own copy.

The engine must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with one worker (``tensor_parallel_size=1``):
one engine per rank. Every vLLM internal used is in `odc_accelerate._compat.vllm`. Facts about vLLM next to a
torch.distributed job (an engine created after ``init_process_group`` joins the job's group, its creation is a
collective, its tear-down would destroy the group): docs/vllm.md.

```python
engine = ODCEngine(model)  # model: an FSDP2-sharded Hugging Face model, e.g. Qwen2ForCausalLM
llm = LLM(path_of_the_initial_model, dtype="float32", enforce_eager=True)  # on every rank, after init_process_group
...
engine.post_optimizer_step()  # new shards published
sync_vllm_weights(llm, engine)  # this rank's engine now holds the trained weights; no collective
outputs = llm.generate(my_prompts, sampling_params)  # this rank's own prompts
...
shutdown_vllm(llm)  # vLLM's groups go, the job's process group stays
```
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .. import model_check
from .._compat import fsdp as fsdp_compat
from ..engine import EngineState, ODCEngine

__all__ = ["VLLMSyncStats", "hf_parameter_name", "iter_full_parameters", "shutdown_vllm", "sync_vllm_weights"]

# Module names that wrappers insert into parameter names (activation checkpointing, torch.compile, FSDP1).
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
# Parameter names of PEFT adapters (the engine gets merged weights: `_LoraMerge`).
_ADAPTER_MARKERS = (".lora_A.", ".lora_B.", ".lora_embedding_A", ".lora_embedding_B", ".base_layer.")
_UNSUPPORTED_ADAPTER_MARKERS = (".lora_embedding_A", ".lora_embedding_B", ".modules_to_save.", ".original_module.")
# What PEFT puts before the wrapped model's own parameter names.
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class _LoraLayer:
    """How to merge one LoRA-wrapped linear layer: its active adapter, scale, and layout (PEFT's ``get_delta_weight``:
    ``transpose(B @ A, fan_in_fan_out) * scaling``)."""

    adapter: str
    scaling: float
    fan_in_fan_out: bool


def _lora_layers(model: nn.Module) -> dict[str, _LoraLayer]:
    """The LoRA-wrapped linear layers of ``model`` by name prefix (``"...q_proj."``), each with one active adapter.

    Raises:
        NotImplementedError: an adapter the sync cannot merge: several active adapters, DoRA, a LoRA bias, LoRA on
            an embedding, an adapter already merged, or ``modules_to_save``.
    """
    layers: dict[str, _LoraLayer] = {}
    for name, module in model.named_modules():
        if not (hasattr(module, "lora_A") and hasattr(module, "base_layer") and hasattr(module, "scaling")):
            continue
        where = name or type(module).__name__
        active = list(getattr(module, "active_adapters", []))
        if len(active) != 1:
            raise NotImplementedError(f"{where} has {len(active)} active LoRA adapters; the vLLM sync merges one")
        adapter = active[0]
        if getattr(module, "merged", False):
            raise NotImplementedError(f"{where}: its adapter is merged already; unmerge it (or train without merging)")
        if getattr(module, "use_dora", {}).get(adapter, False):
            raise NotImplementedError(f"{where} uses DoRA; the vLLM sync merges plain LoRA adapters only")
        if adapter not in module.lora_A:
            raise NotImplementedError(
                f"{where}: LoRA on {type(module.base_layer).__name__} is not supported by the sync"
            )
        if module.lora_B[adapter].bias is not None:
            raise NotImplementedError(f"{where} has a LoRA bias (lora_bias=True); the vLLM sync does not merge it")
        layers[f"{name}." if name else ""] = _LoraLayer(
            adapter, float(module.scaling[adapter]), bool(getattr(module, "fan_in_fan_out", False))
        )
    return layers


class _LoraMerge:
    """Turns a PEFT LoRA model's parameters into the merged weights of the model it wraps, under that model's names.

    Fed each (name, full tensor) in turn: ``base_layer.bias`` passes under the layer's own name; a layer's
    ``base_layer.weight``, ``lora_A.<adapter>.weight`` and ``lora_B.<adapter>.weight`` are held until all three are
    there, then ``base + transpose(B @ A, fan_in_fan_out) * scaling`` goes out as the layer's ``weight`` (PEFT's own
    merge: the same operations in the same order, so the result equals ``merge_and_unload()`` bit for bit); other
    adapters' tensors are dropped. A layer's three tensors are in one FSDP unit unless the wrapping split them, so
    at most one unit's LoRA layers are held.
    """

    def __init__(self, layers: dict[str, _LoraLayer]):
        self.layers = layers
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def feed(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
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
            a, b = held["A"], held["B"]
            # As PEFT: half precision on CPU is multiplied in fp32 (slow half-precision matmuls there), then cast back.
            low = b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
            delta = b.float() @ a.float() if low else b @ a
            if layer.fan_in_fan_out:
                delta = delta.T
            delta = delta * layer.scaling
            return [(prefix + "weight", held["base"].add_(delta.to(b.dtype) if low else delta))]
        return [(name, tensor)]

    def finish(self) -> None:
        if self.pending:
            prefix, held = next(iter(self.pending.items()))
            raise RuntimeError(f"LoRA layer {prefix}: got only {sorted(held)} of its base weight, A and B")


@dataclass
class VLLMSyncStats:
    """What one `sync_vllm_weights` call cost this rank.

    Attributes:
        seconds (`float`): wall time of the whole sync (reads, copies and vLLM's reload).
        gather_seconds (`float`): of which unsharding and copying the parameters (ODC's transport reads included).
        parameters (`int`): tensors handed to vLLM.
        bytes (`int`): their total size.
        units (`int`): FSDP units unsharded (one at a time).
        max_unit_bytes (`int`): the largest unit's full size: what the sync holds outside vLLM at most (once while
            copying it, the unit's unsharded parameters too).
    """

    seconds: float = 0.0
    gather_seconds: float = 0.0
    parameters: int = 0
    bytes: int = 0
    units: int = 0
    max_unit_bytes: int = 0


def hf_parameter_name(name: str) -> str:
    """A parameter's name as a Hugging Face checkpoint spells it: ``name`` without the module names that wrappers
    insert (``_checkpoint_wrapped_module.`` of activation checkpointing, ``_orig_mod.`` of ``torch.compile``,
    ``_fsdp_wrapped_module.``)."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def _units(model: nn.Module) -> list[tuple[nn.Module, Any, list[tuple[str, nn.Module, str]]]]:
    """Each FSDP unit of ``model`` in forward order: its module, its param group, and its parameters as (name under
    ``model``, owning module, attribute name). A parameter belongs to the nearest FSDP module above it (FSDP2's own
    rule; the modules of one ``fully_shard`` call over several modules are one unit); a parameter registered twice
    (tied weights) is listed once, under its first name, as ``named_parameters`` lists it."""
    entries, problem = model_check.served_groups(model)
    if problem is not None:
        raise ValueError(problem)
    # Every module of a unit maps to it: one fully_shard call over several modules (accelerate's tail unit of the
    # final norm and the LM head) gives them one FSDP state, whose first module is the entry's.
    state_unit = {id(fsdp_compat.fsdp_state(module)): i for i, (module, _) in enumerate(entries)}
    unit_of = {
        id(module): state_unit[id(fsdp_compat.fsdp_state(module))]
        for module in model.modules()
        if fsdp_compat.is_fsdp2(module) and id(fsdp_compat.fsdp_state(module)) in state_unit
    }
    params: list[list[tuple[str, nn.Module, str]]] = [[] for _ in entries]
    seen: set[int] = set()

    def walk(module: nn.Module, prefix: str, unit: int | None) -> None:
        unit = unit_of.get(id(module), unit)
        for attr, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if unit is None:
                raise ValueError(
                    f"{prefix}{attr} is outside every FSDP2 unit: shard the root module with fully_shard as well"
                )
            params[unit].append((prefix + attr, module, attr))
        for child_name, child in module.named_children():
            walk(child, f"{prefix}{child_name}.", unit)

    walk(model, "", None)
    return [(module, group, params[i]) for i, (module, group) in enumerate(entries)]


def _check_engine(engine: ODCEngine) -> None:
    if not isinstance(engine, ODCEngine):
        raise TypeError(f"expected the ODCEngine serving the model, got {type(engine).__name__}")
    if engine._state is not EngineState.IN_STEP:
        raise RuntimeError(
            f"the ODC engine is {engine._state.value}: read the full weights between optimizer steps (after "
            "post_optimizer_step() published the new shards and before the next pre_optimizer_step())"
        )
    if engine.sync_every_hook:
        raise ValueError(
            "this ODC engine has sync_every_hook=True (a benchmark arm with a barrier in every gather): its unshards "
            "wait for every rank, so a per-rank weight sync would hang"
        )


@torch.no_grad()
def iter_full_parameters(engine: ODCEngine, stats: VLLMSyncStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of the model that ``engine`` serves, in full, under its Hugging Face name, without collectives.

    One FSDP unit at a time, in forward order: FSDP2's ``unshard`` gathers the unit (its all-gather is ODC's hook,
    which reads each peer's published shard through the transport), the unit's parameters are copied, the unit is
    resharded, and the copies are yielded. A unit that was unsharded already (kept by the step memory policy) is
    copied as it is and stays unsharded. The tensors are fresh copies, so a consumer may keep them (vLLM's reload
    buffers a layer's tensors until the layer is complete); under mixed precision they are in the unit's
    ``param_dtype``, the precision ODC publishes and the training forward computes with.

    A PEFT model with LoRA adapters on linear layers (TRL's ``--use_peft``) yields the merged weights of the model
    it wraps, under that model's names (``base + B @ A * scaling`` per layer, as PEFT's ``merge_and_unload``; without
    ``base_model.model.`` and ``.base_layer``), which is what TRL syncs into vLLM with PEFT.

    Call it on any rank, any number of times, between `~odc_accelerate.ODCEngine.post_optimizer_step` (or the
    engine's creation) and the next `~odc_accelerate.ODCEngine.pre_optimizer_step`; the reads count in the engine's
    step statistics (``gathers``, ``bytes_read``).

    Args:
        engine (`ODCEngine`): the engine serving the model (trained, or frozen for a reference model).
        stats (`VLLMSyncStats`, *optional*): counters to add this call's figures to.

    Yields:
        `tuple[str, torch.Tensor]`: the parameter's name (as in a Hugging Face checkpoint, see `hf_parameter_name`)
        and its full tensor.

    Raises:
        RuntimeError: the engine is inside an optimizer step (between ``pre_optimizer_step`` and
            ``post_optimizer_step``), closed or broken.
        NotImplementedError: the model carries PEFT adapters the sync cannot merge (several active adapters, DoRA,
            a LoRA bias, LoRA on embeddings, ``modules_to_save``).
    """
    _check_engine(engine)
    units = _units(engine.model)
    names = [name for _, _, params in units for name, _, _ in params]
    unsupported = [name for name in names if any(m in name for m in _UNSUPPORTED_ADAPTER_MARKERS)]
    if unsupported:
        raise NotImplementedError(
            f"the model carries PEFT parameters the vLLM sync cannot merge ({unsupported[0]}, ...): LoRA on linear "
            "layers is supported, not LoRA on embeddings or modules_to_save"
        )
    merge = None
    if any(m in name for name in names for m in _ADAPTER_MARKERS):
        merge = _LoraMerge(_lora_layers(engine.model))
    for module, group, params in units:
        start = time.perf_counter()
        kept = fsdp_compat.is_unsharded(group)
        if not kept:
            module.unshard()
        try:
            copies = []
            for name, owner, attr in params:
                tensor = getattr(owner, attr)
                if isinstance(tensor, DTensor):
                    raise RuntimeError(
                        f"{name} is still sharded after unsharding its FSDP unit {type(module).__name__}"
                    )
                copy = tensor.detach().clone()
                for out_name, out in merge.feed(name, copy) if merge is not None else [(name, copy)]:
                    if merge is not None and out_name.startswith(_PEFT_PREFIX):
                        out_name = out_name[len(_PEFT_PREFIX) :]
                    copies.append((hf_parameter_name(out_name), out))
        finally:
            if not kept:
                module.reshard()
        if stats is not None:
            unit_bytes = sum(t.numel() * t.element_size() for _, t in copies)
            stats.units += 1
            stats.parameters += len(copies)
            stats.bytes += unit_bytes
            stats.max_unit_bytes = max(stats.max_unit_bytes, unit_bytes)
            stats.gather_seconds += time.perf_counter() - start
        yield from copies
        del copies
    if merge is not None:
        merge.finish()


def sync_vllm_weights(llm: Any, engine: ODCEngine) -> VLLMSyncStats:
    """Load the current weights of the model that ``engine`` serves into ``llm``, this rank's vLLM engine, in place.

    Local to this rank: the full weights come from `iter_full_parameters` (ODC's transport reads of the peers'
    published shards, no torch.distributed call, no wait for any peer) and go to vLLM's in-place reload one FSDP unit
    at a time. Call it between optimizer steps on whichever ranks generate next; ranks may sync at different times.

    Args:
        llm (`vllm.LLM`): an engine whose core runs in this process (created with
            ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with ``tensor_parallel_size=1``, of the same architecture as the
            trained model (e.g. created from a saved copy of the initial model).
        engine (`ODCEngine`): the engine serving the trained model.

    Returns:
        `VLLMSyncStats`: what the sync cost this rank.

    Raises:
        ValueError: ``llm``'s core runs in another process, or it has more than one worker.
        RuntimeError: the engine is inside an optimizer step.
        CompatError: the installed vLLM lacks an internal the sync uses (`odc_accelerate._compat.vllm`).
    """
    from .._compat import vllm as vllm_compat

    vllm_compat.check_release()
    vllm_compat.worker_of(llm)  # refuse before reading anything
    _check_engine(engine)
    stats = VLLMSyncStats()
    start = time.perf_counter()
    vllm_compat.reload_weights(llm, iter_full_parameters(engine, stats))
    stats.seconds = time.perf_counter() - start
    return stats


def shutdown_vllm(llm: Any, keep_process_group: bool = True) -> None:
    """Shut down this rank's in-process vLLM engine; idempotent.

    An engine created after ``torch.distributed.init_process_group`` joins the job's default process group (and
    creates its own groups over it), and vLLM's tear-down destroys that default group. Here vLLM's own groups are
    destroyed and, with ``keep_process_group``, the job's default group stays for the rest of the run.

    Args:
        llm (`vllm.LLM`): an engine whose core runs in this process.
        keep_process_group (`bool`, *optional*, defaults to `True`): keep torch.distributed's default process group.
            Pass `False` for an engine created before any ``init_process_group`` (its own group then goes too).
    """
    from .._compat import vllm as vllm_compat

    vllm_compat.shutdown_engine(llm, keep_process_group=keep_process_group)
