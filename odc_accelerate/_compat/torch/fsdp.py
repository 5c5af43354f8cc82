"""FSDP2's internals that the engine reads or calls: its state and param groups, the comm hooks, the layouts of the
all-gather and reduce-scatter buffers, the all-gather input, and the folding of a reduced gradient into ``.grad``.

The official hooks (``set_custom_all_gather`` / ``set_custom_reduce_scatter``) carry the per-layer data path, but
reproducing FSDP2's gradient post-processing exactly at the step boundary, and publishing shards outside an
all-gather, needs a few private pieces of FSDP2. The FSDP2 functions, and the parameters they are called with (always
by keyword), are checked when this module is imported; :func:`check` verifies the attributes read on live FSDP2
objects at engine start. Where the supported releases differ, the choice follows `PATHS` (see
:mod:`odc_accelerate._compat.torch`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from .. import CompatError
from . import _FSDP, _MODULE_METHODS, _check_signature, _import, _require, check_torch_release, has

FSDPModule = _import("torch.distributed.fsdp", "FSDPModule")
AllGather = _import(f"{_FSDP}._fsdp_api", "AllGather")
ReduceScatter = _import(f"{_FSDP}._fsdp_api", "ReduceScatter")
HSDPMeshInfo = _import(f"{_FSDP}._fsdp_common", "HSDPMeshInfo")
DDPMeshInfo = _import(f"{_FSDP}._fsdp_common", "DDPMeshInfo")
ShardedState = _import(f"{_FSDP}._fsdp_param", "ShardedState")
_FSDPParam = _import(f"{_FSDP}._fsdp_param", "FSDPParam")
CPUOffloadPolicy = _import("torch.distributed.fsdp", "CPUOffloadPolicy")
_get_param_all_gather_inputs = _import(f"{_FSDP}._fsdp_collectives", "_get_param_all_gather_inputs")
_get_all_gather_input_metadatas = _import(f"{_FSDP}._fsdp_collectives", "_get_all_gather_input_metadatas")
_get_gradient_divide_factors = _import(f"{_FSDP}._fsdp_collectives", "_get_gradient_divide_factors")
_module_state_mapping = _import("torch.distributed._composable_state", "_module_state_mapping")


def _check_private_functions() -> None:
    """The private functions are called by keyword, and FSDP2 calls the hooks the engine implements: a renamed
    parameter must fail here, at import, not bind to the wrong argument."""
    collectives = f"{_FSDP}._fsdp_collectives"
    _check_signature(_get_param_all_gather_inputs, ("fsdp_params",), f"{collectives}._get_param_all_gather_inputs")
    _check_signature(
        _get_all_gather_input_metadatas,
        ("param_all_gather_inputs",),
        f"{collectives}._get_all_gather_input_metadatas",
    )
    _check_signature(
        _get_gradient_divide_factors,
        (
            "reduce_scatter_group",
            "all_reduce_group",
            "reduce_dtype",
            "device_type",
            "factor",
            "force_sum_reduction_for_comms",
        ),
        f"{collectives}._get_gradient_divide_factors",
    )
    _check_signature(_FSDPParam.to_sharded_dtensor, ("tensor",), "FSDPParam.to_sharded_dtensor")
    for comm, call_params in (
        (AllGather, ("output_tensor", "input_tensor", "group", "async_op")),
        (ReduceScatter, ("output_tensor", "input_tensor", "group", "op", "async_op")),
    ):
        _check_signature(comm.allocate, ("size", "dtype", "device"), f"{comm.__name__}.allocate")
        _check_signature(comm.__call__, call_params, f"{comm.__name__}.__call__")


_check_private_functions()


# Attributes read on live objects; checked on the first param group at engine start.
_STATE_ATTRS = ("_fsdp_param_groups" if has("param_groups") else "_fsdp_param_group", "_is_root", "_lazy_init")
_GROUP_ATTRS = (
    "fsdp_params",
    "mesh_info",
    "post_forward_mesh_info",
    "device",
    "offload_policy",
    *(() if has("grad_dtypes") else ("_orig_dtype",)),
    "_reduce_dtype",
    "_module_fqn",
    "gradient_divide_factor",
    "force_sum_reduction_for_comms",
    *(("reduce_scatter_unused_params",) if has("reduce_scatter_unused_params") else ()),
    *(("_reduce_scatter_param_indices",) if has("reduce_scatter_order") else ()),
    "_all_gather_comm",
    "_reduce_scatter_comm",
)
_PARAM_ATTRS = (
    "sharded_param",
    "sharded_state",
    "sharded_size",
    "padded_sharded_param_size",
    "contiguous_sharded_stride",
    "to_sharded_dtensor",
    "param_dtype",
    "orig_dtype",
    *(("sharded_grad_dtype", "unsharded_grad_dtype") if has("grad_dtypes") else ()),
    "_param_fqn",
)


def check(model: nn.Module) -> None:
    """Verify every internal the engine uses on ``model`` (an FSDP2 root, after :func:`lazy_init`).

    Raises :class:`~odc_accelerate._compat.CompatError` naming the first missing piece.
    """
    check_torch_release()
    for method in _MODULE_METHODS:
        _require(model, method, "FSDPModule")
    if has("reduce_scatter_unused_params"):
        _require(model, "set_reduce_scatter_unused_params", "FSDPModule")
    groups = [g for _, s in all_states(model) for g in param_groups(s)]
    if groups:
        for attr in _GROUP_ATTRS:
            _require(groups[0], attr, "FSDPParamGroup")
        params = [p for g in groups for p in g.fsdp_params]
        if params:
            for attr in _PARAM_ATTRS:
                _require(params[0], attr, "FSDPParam")


def is_fsdp2(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def fsdp_state(module: nn.Module) -> Any:
    return _require(module, "_get_fsdp_state", "FSDPModule")()


def per_param_placer(mesh: Any) -> Any:
    """A function ``placement -> result`` for ``fully_shard(shard_placement_fn=...)`` that shards a parameter with
    ``placement`` on ``mesh`` instead of the call's own (several param groups in one call; the tests build such
    models). Every result shares one mesh info, as FSDP2 requires of params on one process group. torch 2.12 and
    newer: 2.11 has no per-param meshes, and this raises `CompatError` there."""
    info = _import(f"{_FSDP}._fsdp_common", "FSDPMeshInfo")(mesh, shard_mesh_dim=0)
    result = _import(f"{_FSDP}._fsdp_common", "ShardPlacementResult")
    return lambda placement: result(placement, info)


def all_states(root: nn.Module) -> Iterator[Any]:
    """FSDP states of ``root`` and its submodules, each once, in module order (forward order for stacks)."""
    seen: set[int] = set()
    for module in root.modules():
        if is_fsdp2(module):
            state = fsdp_state(module)
            if id(state) not in seen:
                seen.add(id(state))
                yield module, state


def param_groups(state: Any) -> list[Any]:
    """The FSDPParamGroups of one FSDP state (several only with per-param meshes; torch 2.11 keeps at most one)."""
    if has("param_groups"):
        return list(_require(state, "_fsdp_param_groups", "FSDPState"))
    group = _require(state, "_fsdp_param_group", "FSDPState")
    return [] if group is None else [group]


def lazy_init(root: nn.Module) -> None:
    """Run FSDP2's root lazy init now (it normally runs at the first forward); idempotent."""
    check_torch_release()
    state = fsdp_state(root)
    for attr in _STATE_ATTRS:
        _require(state, attr, "FSDPState")
    if state._is_root is False or _enclosing_fsdp_module(root) is not None:
        raise ValueError(
            "ODCEngine needs the ROOT FSDP2 module (the outermost module passed to fully_shard), got a nested one"
        )
    state._lazy_init()


def _enclosing_fsdp_module(module: nn.Module) -> nn.Module | None:
    """An FSDP2 module that contains ``module`` as a strict descendant, if any (before lazy init the
    nested/root distinction exists only in the module tree)."""
    for other in list(_module_state_mapping.keys()):
        if other is not module and is_fsdp2(other) and any(m is module for m in other.modules()):
            return other
    return None


# ----------------------------------------------------------------- param-group views
def group_fqn(group: Any) -> str:
    return group._module_fqn or "<root>"


def is_hsdp_or_ddp(group: Any) -> bool:
    return isinstance(group.mesh_info, (HSDPMeshInfo, DDPMeshInfo)) or group.mesh_info.mesh.ndim != 1


def is_hsdp(group: Any) -> bool:
    """A (replicate, shard) 2-D mesh: FSDP2 shards within ``shard_process_group`` and all-reduces across
    ``replicate_process_group``."""
    return isinstance(group.mesh_info, HSDPMeshInfo) and group.mesh_info.mesh.ndim == 2


def mesh_problem(group: Any) -> str | None:
    """Why ODC cannot serve ``group``'s mesh (a sentence), or None for a 1-D FSDP mesh or a 2-D HSDP one."""
    if is_hsdp(group) or not is_hsdp_or_ddp(group):
        return None
    return (
        f"ODC supports a 1-D FSDP mesh or a 2-D (replicate, shard) HSDP mesh; {group_fqn(group)} uses "
        f"{type(group.mesh_info).__name__} on a {group.mesh_info.mesh.ndim}-D mesh. Pass a 1-D DeviceMesh (full "
        "shard) or a 2-D (dp_replicate, dp_shard) one to fully_shard."
    )


def replicate_group(group: Any) -> Any:
    """The process group FSDP2 all-reduces ``group``'s gradients over (HSDP), else None."""
    return group.mesh_info.replicate_process_group if is_hsdp(group) else None


def mesh_of(group: Any) -> Any:
    """The DeviceMesh ``group``'s params are sharded on."""
    return group.mesh_info.mesh


def mesh_ranks(group: Any) -> list[list[int]]:
    """The global ranks of ``group``'s mesh, one list per row (on an HSDP mesh: per shard group)."""
    ranks = mesh_of(group).mesh
    return ranks.reshape(-1, ranks.shape[-1]).tolist()


def check_hsdp(group: Any) -> None:
    """Verify the FSDP2 internals the engine touches on an HSDP mesh (at start, not at the first step)."""
    for attr in ("_partial_reduce_output", "all_reduce_grads"):
        _require(group, attr, "FSDPParamGroup")


def clear_partial_reduce_output(group: Any) -> None:
    """Drop the buffer FSDP2 keeps between reduce-scatters that skip the HSDP all-reduce (``all_reduce_grads``
    False). Under ODC it only ever holds the zeros the hook returns; dropping it frees that memory between steps."""
    _require(group, "_partial_reduce_output", "FSDPParamGroup")
    group._partial_reduce_output = None


def uses_hpz(group: Any) -> bool:
    """``reshard_after_forward=int``: params are resharded to a smaller post-forward mesh."""
    post = group.post_forward_mesh_info
    return post is not None and post != group.mesh_info


def offloads(group: Any) -> bool:
    return isinstance(group.offload_policy, CPUOffloadPolicy)


def shard_group(group: Any) -> Any:
    return group.mesh_info.shard_process_group


def trainable_params(group: Any) -> list[Any]:
    """Params that require grad, in the order FSDP2 packs them into a reduce-scatter: the layout of the engine's
    accumulator (and of every reduce-scatter, where torch has ``reduce_scatter_unused_params``).

    That is the group's ``fsdp_params`` order, except from torch 2.15 on, where FSDP2 packs the params by gradient
    dtype (``_reduce_scatter_param_indices``, set at lazy init; the same order while all gradients share a dtype).
    """
    params = group.fsdp_params
    if has("reduce_scatter_order"):
        order = group._reduce_scatter_param_indices
        if sorted(order) != list(range(len(params))):
            raise CompatError(
                f"FSDPParamGroup._reduce_scatter_param_indices of {group_fqn(group)} is not an order of its "
                f"{len(params)} params ({order}): FSDP2's lazy init has not run, or torch {torch.__version__} packs "
                "reduce-scatters differently from the tested releases."
            )
        params = [params[i] for i in order]
    return [p for p in params if p.sharded_param.requires_grad]


def group_device(group: Any) -> torch.device:
    return group.device


def group_layout(group: Any) -> list[tuple[str, tuple[int, ...], str]]:
    """(fqn, padded shard size, original dtype) of each parameter of ``group``: what must agree across ranks."""
    return [(p._param_fqn, tuple(p.padded_sharded_param_size), str(p.orig_dtype)) for p in group.fsdp_params]


def reduce_dtype(group: Any) -> torch.dtype | None:
    """dtype of the reduce-scatter buffers, as FSDP2 picks it; None without trainable params.

    Before torch 2.15: the group's ``reduce_dtype``, else the params' compute dtype (``param_dtype``, else the
    original one). From 2.15 on (``FSDPParamGroup._get_reduce_dtype``): the group's ``reduce_dtype``, else the
    promotion of the dtypes the params accumulate gradients in (``unsharded_grad_dtype``: the original dtype unless
    a param sets ``grad_dtype``), so fp32 params computed in bf16 reduce in fp32 unless ``reduce_dtype`` says bf16.
    """
    params = trainable_params(group)
    if not params:
        return None
    if not has("grad_dtypes"):
        return group._reduce_dtype or params[0].param_dtype or params[0].orig_dtype
    if group._reduce_dtype is not None:
        return group._reduce_dtype
    if (problem := reduce_dtype_problem(group)) is not None:
        raise ValueError(problem)
    return functools.reduce(torch.promote_types, {p.unsharded_grad_dtype for p in params})


def reduce_dtype_problem(group: Any) -> str | None:
    """Why the dtype of ``group``'s reduce-scatters is not fixed when the engine is built (a sentence), or None.

    From torch 2.15 on, a trainable param whose ``grad_dtype`` is explicitly None takes gradients of any dtype, so
    without a ``reduce_dtype`` the reduce dtype (the engine's accumulator dtype) depends on each backward; FSDP2
    itself refuses such a param once unused params are reduced, as the engine has them.
    """
    if not has("grad_dtypes") or group._reduce_dtype is not None:
        return None
    loose = [p._param_fqn for p in trainable_params(group) if p.unsharded_grad_dtype is None]
    if not loose:
        return None
    return (
        f"ODC needs a fixed gradient dtype per param group, but {loose[0]} in {group_fqn(group)} has grad_dtype=None "
        "and the group has no reduce_dtype. Pass MixedPrecisionPolicy(reduce_dtype=...) to fully_shard, or leave "
        "grad_dtype unset."
    )


def grad_dtypes(group: Any) -> list[torch.dtype | None]:
    """The dtype each trainable param's reduced gradient is cast to (None: left in the reduce dtype), in
    `trainable_params` order: the group's original dtype before torch 2.15, each param's ``sharded_grad_dtype``
    from 2.15 on."""
    if has("grad_dtypes"):
        return [p.sharded_grad_dtype for p in trainable_params(group)]
    return [group._orig_dtype] * len(trainable_params(group))


def reduce_scatter_numel(group: Any) -> int:
    """Elements of one rank's row of the reduce-scatter input (= size of the owner's accumulator)."""
    return sum(p.padded_sharded_param_size.numel() for p in trainable_params(group))


def _check_sharded(group: Any) -> None:
    for p in group.fsdp_params:
        if p.sharded_state != ShardedState.SHARDED:
            raise RuntimeError(
                f"ODC publishes shards after the optimizer step, but {p._param_fqn} is {p.sharded_state}; "
                "keep the default reshard_after_backward=True"
            )


def all_gather_input(group: Any) -> torch.Tensor:
    """This rank's all-gather input for ``group``, flat, exactly as FSDP2 copies it in.

    Mixed-dtype groups are sent as bytes (uint8), as ``foreach_all_gather`` does.
    """
    _check_sharded(group)
    inputs = _get_param_all_gather_inputs(fsdp_params=group.fsdp_params)
    _, _, dtype = _get_all_gather_input_metadatas(param_all_gather_inputs=inputs)
    flat = [(t.view(torch.uint8) if dtype == torch.uint8 else t).reshape(-1) for ts in inputs for t in ts]
    return torch.cat(flat)


def _has_extension(p: Any) -> bool:
    """A parameter whose all-gather inputs a tensor subclass makes (``fsdp_pre_all_gather``, e.g. float8)."""
    return hasattr(p._sharded_local_tensor, "fsdp_pre_all_gather")


def all_gather_input_layout(group: Any) -> tuple[int, torch.dtype]:
    """(elements, dtype) of `all_gather_input` for ``group``, read from FSDP2's metadata without building it: each
    parameter sends its padded shard in its compute dtype, and a group of several dtypes is sent as bytes.

    A parameter with an all-gather extension (``fsdp_pre_all_gather``, e.g. float8) chooses its own inputs, whose sizes
    only the extension knows: its inputs are built (and dropped) one parameter at a time, so that at most one
    parameter's inputs exist at once, as in `copy_all_gather_input`. That memory is allocated before the 'cuda'
    transport's memory check, which needs the sizes.
    """
    _check_sharded(group)
    sizes: list[tuple[int, torch.dtype]] = []
    for p in group.fsdp_params:
        if _has_extension(p):
            sizes += [(t.numel(), t.dtype) for t in _get_param_all_gather_inputs(fsdp_params=[p])[0]]
        else:
            sizes.append((p.padded_sharded_param_size.numel(), p.param_dtype or p.orig_dtype))
    dtypes = {dtype for _, dtype in sizes}
    if len(dtypes) == 1:
        return sum(n for n, _ in sizes), dtypes.pop()
    return sum(n * dtype.itemsize for n, dtype in sizes), torch.uint8


def copy_all_gather_input(group: Any, out: torch.Tensor) -> None:
    """Write `all_gather_input` for ``group`` into ``out`` one parameter at a time: at most one parameter's cast
    copy exists at once, rather than the whole group's (what keeps the engine's publish within its memory margin)."""
    _check_sharded(group)
    flat_out = out.view(torch.uint8) if out.dtype == torch.uint8 else out
    offset = 0
    for p in group.fsdp_params:
        for t in _get_param_all_gather_inputs(fsdp_params=[p])[0]:
            flat = (t.view(torch.uint8) if out.dtype == torch.uint8 else t).reshape(-1)
            flat_out[offset : offset + flat.numel()].copy_(flat)
            offset += flat.numel()
    if offset != out.numel():
        raise RuntimeError(
            f"FSDP2's all-gather input of {group_fqn(group)} has {offset} elements, but ODC planned {out.numel()}; "
            "the parameters changed since the engine was built"
        )


def postdivide_factor(group: Any) -> float | None:
    """What FSDP2 divides the summed reduce-scatter output by (sum reduction forced on)."""
    _, post, _, _ = _get_gradient_divide_factors(
        reduce_scatter_group=shard_group(group),
        all_reduce_group=replicate_group(group),  # HSDP: FSDP2 divides by replicas x shards
        reduce_dtype=reduce_dtype(group),
        device_type=group.device.type,
        factor=group.gradient_divide_factor,
        force_sum_reduction_for_comms=True,
    )
    return post


def fold_into_grads(group: Any, reduce_output: torch.Tensor) -> None:
    """Apply FSDP2's post-reduce-scatter processing to ``reduce_output`` (this rank's summed slice).

    Mirrors ``foreach_reduce`` after the collective: postdivide, cast each run of params that share a gradient
    dtype (`grad_dtypes`; one run before torch 2.15) to it, split per parameter with ``as_strided`` and ``+=`` into
    (or create) ``sharded_param.grad``. ``reduce_output`` must be fresh memory: new gradients become views of it (or
    of their run's cast), as in FSDP2; where every ``.grad`` exists (`all_grads_exist`) it is only read.
    """
    post = postdivide_factor(group)
    if post is not None and post != 1:
        reduce_output.div_(post)
    params = trainable_params(group)
    offset = 0
    # FSDP2 2.15 also copies an uncast run out when the cast runs are larger (so that views of it do not keep the
    # whole output alive): memory only, the values are the same.
    for dtype, pairs in itertools.groupby(zip(params, grad_dtypes(group), strict=True), key=lambda pair: pair[1]):
        run = [p for p, _ in pairs]
        numel = sum(p.padded_sharded_param_size.numel() for p in run)
        output = reduce_output if numel == reduce_output.numel() else reduce_output.narrow(0, offset, numel)
        if dtype is not None and output.dtype != dtype:
            output = output.to(dtype)
        view_offset = output.storage_offset()
        for p in run:
            new_grad = torch.as_strided(
                output, size=p.sharded_size, stride=p.contiguous_sharded_stride, storage_offset=view_offset
            )
            if p.sharded_param.grad is not None:
                p.sharded_param.grad._local_tensor += new_grad
            else:
                p.sharded_param.grad = p.to_sharded_dtensor(tensor=new_grad)
            view_offset += p.padded_sharded_param_size.numel()
        offset += numel


def all_grads_exist(group: Any) -> bool:
    """Whether every trainable param of ``group`` has a ``.grad`` (then `fold_into_grads` only adds into them and
    keeps no view of its input)."""
    return all(p.sharded_param.grad is not None for p in trainable_params(group))


def get_comms(group: Any) -> tuple[Any, Any]:
    return group._all_gather_comm, group._reduce_scatter_comm


def set_comms(group: Any, all_gather: Any, reduce_scatter: Any) -> None:
    """Install comm objects directly on a param group (used to restore FSDP2's defaults at close)."""
    group._all_gather_comm = all_gather
    group._reduce_scatter_comm = reduce_scatter


def sum_and_unused_flags(group: Any) -> tuple[bool, bool | None]:
    """``force_sum_reduction_for_comms`` and ``reduce_scatter_unused_params`` of ``group`` (None where torch has no
    such flag)."""
    unused = group.reduce_scatter_unused_params if has("reduce_scatter_unused_params") else None
    return group.force_sum_reduction_for_comms, unused


def set_sum_and_unused_flags(group: Any, force_sum: bool, unused: bool | None) -> None:
    group.force_sum_reduction_for_comms = force_sum
    if unused is not None:
        group.reduce_scatter_unused_params = unused


def is_unsharded(group: Any) -> bool:
    return bool(group.is_unsharded)


def reshard(group: Any) -> None:
    """Free ``group``'s gathered parameters (FSDP2 registers the sharded ones on the modules again)."""
    group.reshard()
