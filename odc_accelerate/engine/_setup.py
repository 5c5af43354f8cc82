"""What `ODCEngine.__init__` checks and builds before the first step.

In order: the arguments (before any collective, so that the same bad value raises on every rank), FSDP2's lazy
initialisation, the param groups ODC serves and the mesh they live on (`serve`: the ranks agree on the model there),
the transport's buffers (`build_groups`), the hooks that replace FSDP2's collectives (`install_hooks`, undone by
`restore_hooks`), and the refusals for a rank out of GPU memory on the way.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import memory_spec
from .._compat import warn_if_untested
from .._compat.torch import fsdp as compat
from .._compat.torch import keep as keep_compat
from .._compat.torch import layout as layout_compat
from ..transport import BufferSpec, Transport, TransportChoice, choose_transport, create_transport
from ..transport.base import is_out_of_memory
from ..transport.claims import claim_counter
from ..transport.ordered import contribution_specs
from ..transport.registry import spans_hosts
from . import hsdp, model_check
from ._common import Served, ServedGroup
from ._hooks import _ODCAllGather, _ODCReduceScatter, _ODCReduceScatterHSDP
from .report import EngineReport

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- checks before any collective
def check_arguments(
    model: nn.Module, timeout: float, *, sync_every_hook: bool, policy: Any, memory_policy: Any
) -> None:
    """Refuse bad arguments, a model FSDP2 did not shard, or a missing process group; no peer is involved.

    Args:
        policy: ``memory_policy`` as `memory_spec.parse_policy` read it.
    """
    if sync_every_hook and policy != [("*", "neither")]:
        raise ValueError(
            "sync_every_hook (a benchmark arm with a barrier in every hook) needs every rank to gather and reduce "
            f"in lockstep: use memory_policy='neither' with it, not {memory_policy!r}"
        )
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not compat.is_fsdp2(model):
        raise TypeError(
            f"ODCEngine needs a model wrapped with FSDP2 (torch.distributed.fsdp.fully_shard), got "
            f"{type(model).__name__}. Call fully_shard on each block and then on the root; FSDP1 "
            "(FullyShardedDataParallel) and DDP are not supported."
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ODCEngine needs torch.distributed to be initialised (init_process_group) first")
    warn_if_untested("torch", "The FSDP2 internals it reads may behave differently there.")


def check_frozen(model: nn.Module) -> None:
    """A frozen (gather-only) engine serves a model no parameter of which requires grad."""
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if trainable:
        raise ValueError(
            f"ODCEngine(frozen=True) serves models that are never trained, but {len(trainable)} parameter(s) "
            f"require grad (first: {trainable[0]}). Call model.requires_grad_(False) before fully_shard, or "
            "use frozen=False for a trained model."
        )


def out_of_memory(err: BaseException, device: torch.device, what: str, detail: str, advice: str) -> RuntimeError:
    """The refusal for a CUDA out-of-memory error ``err`` met on this rank in the engine's set-up (caused by ``err``).

    Its text names this rank by its global rank: peers that raise it too (`model_check.agree_on_model`) say who ran
    short. Free memory is read after torch's cache is released, as the transport's check reads it; a device other than
    CUDA has no such reading.
    """
    free = memory_spec.free_and_total(device, release_cache=True)[0] if device.type == "cuda" else None
    text = memory_spec.out_of_memory_text(
        f"rank {dist.get_rank()}", what, free=free, detail=detail, ran_out="it ran out of GPU memory", advice=advice
    )
    refusal = RuntimeError(text)
    refusal.__cause__ = err
    return refusal


def _model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def lazy_init(model: nn.Module) -> RuntimeError | None:
    """Run FSDP2's lazy initialisation and check its state; returns this rank's refusal if it ran out of memory.

    The refusal is carried into the ranks' agreement on the model (`serve`, which raises it on every rank): a rank
    that raised alone would leave its peers waiting for it in the agreement's collective until the process group's
    timeout.
    """
    try:
        compat.lazy_init(model)
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        # FSDP2's own set-up (streams, buffers), before ODC allocates anything: with a GPU this full, say so instead of
        # a bare driver error.
        return out_of_memory(
            err,
            _model_device(model),
            "FSDP2's lazy initialisation",
            "its CUDA streams and buffers, made when the ODC engine starts, before ODC allocates anything",
            "Create the engine (or run the first step) with more GPU memory free: a smaller model or batch, fewer "
            "other processes on this GPU, or more GPUs to shard over",
        )
    compat.check(model)  # FSDP2's state after its lazy init
    return None


# ---------------------------------------------------------------------- the served groups and their mesh
def _gather_layouts(entries: list[model_check.Entry]) -> tuple[list[tuple[int, torch.dtype]], RuntimeError | None]:
    """Each group's all-gather input (numel, dtype), or this rank's refusal if building them ran out of memory."""
    try:
        # From FSDP2's metadata, except for parameters with an all-gather extension, whose inputs are built (one
        # parameter at a time) to learn their size: that much is allocated before the transport has checked its
        # memory (see `compat.all_gather_input_layout`).
        return [compat.all_gather_input_layout(group) for _, group in entries], None
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        return [], out_of_memory(
            err,
            compat.group_device(entries[0][1]),
            "the all-gather inputs of its parameters with an all-gather extension",
            "FSDP2's fsdp_pre_all_gather, e.g. float8: built one parameter at a time to learn their sizes, "
            "before ODC's memory check",
            "Create the engine with more GPU memory free, or shard over more GPUs",
        )


def serve(model: nn.Module, refusal: RuntimeError | None, transport: str | Transport) -> Served:
    """Collective: the param groups ODC serves, once every rank agrees that it can serve them.

    A refusal found on some ranks only (``refusal``, this rank's from `lazy_init`, or one found here) is raised on
    every rank (`model_check.agree_on_model`), before the next collective.
    """
    entries, problem = model_check.served_groups(model)
    layouts: list[tuple[int, torch.dtype]] = []
    if refusal is None and problem is None:
        layouts, refusal = _gather_layouts(entries)
    shard_pg = compat.shard_group(entries[0][1]) if entries else None
    replicate_pg = compat.replicate_group(entries[0][1]) if entries else None
    if replicate_pg is not None and compat.mesh_of(entries[0][1]).size() != dist.get_world_size():
        problem = problem or (
            f"ODC with HSDP needs the (replicate, shard) mesh to cover every rank of the job, but it has "
            f"{compat.mesh_of(entries[0][1]).size()} of {dist.get_world_size()}. Build the mesh over all ranks."
        )
    # HSDP: the whole job checks together (a refusal on one replica must reach the others).
    model_check.agree_on_model(entries, refusal or problem, group=None if replicate_pg is not None else shard_pg)
    device = compat.group_device(entries[0][1])
    if replicate_pg is not None:
        compat.check_hsdp(entries[0][1])
        hsdp.check_shard_group_hosts(compat.mesh_ranks(entries[0][1]), spans_hosts=spans_hosts(transport))
    return Served(entries, layouts, shard_pg, replicate_pg, device)


def build_groups(served: Served, *, frozen: bool) -> tuple[list[ServedGroup], dict[str, BufferSpec]]:
    """The engine's view of each served group, and the transport buffers: per group ``p<i>`` (the published shard) and
    ``g<i>`` (the gradient accumulator; none for a frozen engine or a group without trainable parameters)."""
    groups: list[ServedGroup] = []
    specs: dict[str, BufferSpec] = {}
    for index, ((module, group), (gather_numel, gather_dtype)) in enumerate(
        zip(served.entries, served.layouts, strict=True)
    ):
        rdtype = compat.reduce_dtype(group)
        g = ServedGroup(
            index=index,
            fqn=compat.group_fqn(group),
            group=group,
            module=module,
            gather_numel=gather_numel,
            gather_dtype=gather_dtype,
            reduce_numel=compat.reduce_scatter_numel(group),
            reduce_dtype=rdtype,
            saved_comms=compat.get_comms(group),
            saved_flags=compat.sum_and_unused_flags(group),
        )
        groups.append(g)
        specs[f"p{index}"] = BufferSpec(numel=g.gather_numel, dtype=g.gather_dtype)
        if rdtype is not None and not frozen:
            specs[f"g{index}"] = BufferSpec(numel=g.reduce_numel, dtype=rdtype, accumulated=True)
    # Exchanged at every step's barrier: per group whether this rank's backward reached it, then the fingerprint of
    # the optimizer's param groups (`pre_optimizer_step`).
    specs["touched"] = BufferSpec(numel=len(groups) + model_check.FINGERPRINT_BYTES, dtype=torch.uint8)
    return groups, specs


def sum_dtype(reduce_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype an owner sums the ordered reduction's contributions in: the accumulator's dtype under ``atomic`` on the
    same transport (16-bit floats widened to fp32 on CUDA, as the ``cuda`` transport's accumulators; the reduce dtype
    on CPU transports)."""
    if device.type == "cuda":
        from ..transport.cuda.segments import accumulator_dtype

        return accumulator_dtype(reduce_dtype)
    return reduce_dtype


def ordered_specs(
    groups: list[ServedGroup], specs: dict[str, BufferSpec], world_size: int, device: torch.device
) -> dict[str, BufferSpec]:
    """The buffers of the ordered reduction, in place of the atomic reduction's accumulators in ``specs``.

    Per group with an accumulator ``g<i>``: this rank's contributions to every owner, ``"c<i>/to<o>"`` (one shard
    each, in the reduce dtype: together one unsharded gradient), and ``g<i>`` itself, now the owner's sum of the ranks'
    contributions, which nobody adds into (`sum_dtype`). Per reduce dtype, ``"scratch/<dtype>"``: one shard of the
    largest group, what each contribution is read into before it is added. All of it is registered with the transport,
    so that its memory check (the ``cuda`` transport's, before anything is allocated) counts it, and refuses on every
    rank a job that does not fit.
    """
    out: dict[str, BufferSpec] = {}
    scratch: dict[torch.dtype, int] = {}
    for name, spec in specs.items():
        out[name] = spec
    for g in groups:
        name = f"g{g.index}"
        if name not in specs:
            continue
        out[name] = BufferSpec(numel=g.reduce_numel, dtype=sum_dtype(g.reduce_dtype, device))
        out.update(contribution_specs(f"c{g.index}", g.reduce_numel, g.reduce_dtype, world_size))
        scratch[g.reduce_dtype] = max(scratch.get(g.reduce_dtype, 0), g.reduce_numel)
    for dtype, numel in scratch.items():
        out[scratch_name(dtype)] = BufferSpec(numel=numel, dtype=dtype)
    return out


def scratch_name(dtype: torch.dtype) -> str:
    """The ordered reduction's read buffer for contributions of ``dtype``."""
    return f"scratch/{str(dtype).removeprefix('torch.')}"


def replica_reducer(
    served: Served, groups: list[ServedGroup], specs: dict[str, BufferSpec], timeout: float, bucket_bytes: int
) -> hsdp.ReplicaReducer:
    """HSDP: the once-per-step all-reduce of the accumulators across replicas."""
    layout = [(g.index, g.reduce_numel, specs[f"g{g.index}"].dtype) for g in groups if f"g{g.index}" in specs]
    return hsdp.ReplicaReducer(
        served.replicate_pg, layout, len(groups), served.device, timeout, bucket_bytes=bucket_bytes
    )


# ---------------------------------------------------------------------- hooks and claims
def install_hooks(
    groups: list[ServedGroup],
    gather: Callable[[int, torch.Tensor], None],
    scatter_accumulate: Callable[[int, torch.Tensor, torch.Tensor, Any], None] | None,
    *,
    hsdp_mesh: bool,
) -> None:
    """Route each group's FSDP2 collectives to ``gather`` / ``scatter_accumulate`` (called with the group's index;
    ``None``: a frozen engine, FSDP2's reduce-scatter stays); `restore_hooks` undoes it."""
    for g in groups:
        # The engine owns the divisor (applied at the fold): sum-only hooks, and a known layout.
        module = g.module
        module.set_force_sum_reduction_for_comms(True)
        layout_compat.fix_reduce_scatter_layout(module, defer_all_reduce=hsdp_mesh)
        module.set_custom_all_gather(_ODCAllGather(functools.partial(gather, g.index)))
        if scatter_accumulate is not None:
            hook = _ODCReduceScatterHSDP if hsdp_mesh else _ODCReduceScatter
            module.set_custom_reduce_scatter(hook(functools.partial(scatter_accumulate, g.index)))
        keep_compat.check_keep_support(g.group)
        g.saved_keep = keep_compat.keep_flags(g.group)


def restore_hooks(groups: list[ServedGroup]) -> None:
    """Give each group back FSDP2's own collectives and the user's switches (what the memory policy changed too)."""
    for g in groups:
        if g.saved_keep is not None:
            keep_compat.set_keep(g.group, g.saved_keep, False, False)
        compat.set_comms(g.group, *g.saved_comms)
        compat.set_sum_and_unused_flags(g.group, *g.saved_flags)


def claims(transport: Transport, shard_pg: Any, *, frozen: bool, replicas: int) -> Any:
    """The dynamic plan's counter: the transport's own (no communication here), or the store fallback for a transport
    without one (one broadcast, here at set-up and never inside a step). On an HSDP mesh every rank of every replica
    claims from one queue, beyond the shard group's transport (one host): the store. A frozen engine claims none."""
    if frozen:
        return None
    if replicas > 1:
        return claim_counter(None)
    return claim_counter(transport, shard_pg)


def setup_refusal(err: BaseException, device: torch.device, held: int) -> RuntimeError:
    """The refusal for running out of GPU memory after the transport allocated ``held`` bytes (registering the
    buffers, installing the hooks, publishing the first shards)."""
    return out_of_memory(
        err,
        device,
        "ODC's set-up",
        f"its transport holds {held / 2**20:.1f} MiB per rank, and publishing the first shards needs room "
        "for one parameter's copy at a time",
        "Free memory before creating the engine (load the model after it, a smaller batch), accumulate in "
        "bf16, or shard over more GPUs",
    )


def open_transport(
    requested: str | Transport, served: Served, *, rank: int, world_size: int, timeout: float, atomics: bool
) -> tuple[TransportChoice, Transport]:
    """Collective under ``auto``: the transport over the shard group, and why (`choose_transport`)."""
    device, group = served.device, served.shard_pg
    choice = choose_transport(requested, device=device, world_size=world_size, group=group, atomics=atomics)
    name = requested if isinstance(requested, Transport) else choice.name
    transport = create_transport(name, rank=rank, world_size=world_size, timeout=timeout, device=device, group=group)
    return choice, transport


def setup_report(engine: Any, choice: TransportChoice, reduction_reason: str) -> EngineReport:
    """What the set-up of ``engine`` (an `ODCEngine`, untyped so that this module does not import it back) chose,
    once its buffers are registered (the ``cuda`` transport's accumulate path is chosen then); `ODCEngine.report` adds
    what the memory policy keeps now."""
    return EngineReport(
        transport=choice.name,
        transport_reason=choice.reason,
        accumulate_path=engine.transport.accumulate_path,
        accumulate_reason=engine.transport.accumulate_reason,
        reduction=None if engine.frozen else engine.reduction,
        reduction_reason=reduction_reason,
        param_groups=len(engine.param_groups),
        frozen=engine.frozen,
        ranks=engine.world_size,
        replicas=engine.replicas,
        replicate_buckets=len(engine.replicate_buckets),
        memory_policy=str(engine.memory_policy),
        memory="",
    )


def log_ready(engine: Any) -> None:
    """One line per rank once the engine is built: what it serves, over what, and what the memory policy keeps."""
    logger.info("ODC engine on rank %d/%d: %s", engine.rank, engine.world_size, engine.report().describe())
