"""Every torch internal that odc_accelerate reads or calls, in one place, checked against the installed torch.

The official hooks (``set_custom_all_gather`` / ``set_custom_reduce_scatter``) carry the per-layer data path, but
reproducing FSDP2's gradient post-processing exactly at the step boundary, and publishing shards outside an
all-gather, needs a few private pieces of FSDP2; the CUDA transport needs torch's private symmetric memory. The FSDP2
functions, and the parameters they are called with (always by keyword), are checked when this module is imported;
:func:`check` verifies the attributes read on live FSDP2 objects at engine start. Each raises
:class:`~odc_accelerate._compat.CompatError` naming whatever is missing, so a torch upgrade fails loudly at start-up
instead of training wrongly. The tested torch versions are ``TESTED["torch"]`` in :mod:`odc_accelerate._compat`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from . import CompatError, check_signature, import_attr, require, untested_warning

_LIBRARY = "torch"


def _import(module: str, attr: str) -> Any:
    return import_attr(module, attr, library=_LIBRARY)


def _require(obj: Any, attr: str, where: str) -> Any:
    return require(obj, attr, library=_LIBRARY, where=where)


def _check_signature(func: Any, params: tuple[str, ...], where: str) -> None:
    check_signature(func, params, library=_LIBRARY, where=where)


_FSDP = "torch.distributed.fsdp._fully_shard"
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
_STATE_ATTRS = ("_fsdp_param_groups", "_is_root", "_lazy_init")
_GROUP_ATTRS = (
    "fsdp_params",
    "mesh_info",
    "post_forward_mesh_info",
    "device",
    "offload_policy",
    "_orig_dtype",
    "_reduce_dtype",
    "_module_fqn",
    "gradient_divide_factor",
    "force_sum_reduction_for_comms",
    "reduce_scatter_unused_params",
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
    "_param_fqn",
)


def check(model: nn.Module) -> None:
    """Verify every internal the engine uses on ``model`` (an FSDP2 root, after :func:`lazy_init`).

    Raises :class:`~odc_accelerate._compat.CompatError` naming the first missing piece.
    """
    groups = [g for _, s in all_states(model) for g in s._fsdp_param_groups]
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
    """The FSDPParamGroups of one FSDP state (several only with per-param meshes)."""
    return list(state._fsdp_param_groups)


def lazy_init(root: nn.Module) -> None:
    """Run FSDP2's root lazy init now (it normally runs at the first forward); idempotent."""
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


def uses_hpz(group: Any) -> bool:
    """``reshard_after_forward=int``: params are resharded to a smaller post-forward mesh."""
    post = group.post_forward_mesh_info
    return post is not None and post != group.mesh_info


def offloads(group: Any) -> bool:
    return isinstance(group.offload_policy, CPUOffloadPolicy)


def shard_group(group: Any) -> Any:
    return group.mesh_info.shard_process_group


def trainable_params(group: Any) -> list[Any]:
    """Params that take part in the reduce-scatter, in its order (with ``reduce_scatter_unused_params``)."""
    return [p for p in group.fsdp_params if p.sharded_param.requires_grad]


def group_device(group: Any) -> torch.device:
    return group.device


def group_layout(group: Any) -> list[tuple[str, tuple[int, ...], str]]:
    """(fqn, padded shard size, original dtype) of each parameter of ``group``: what must agree across ranks."""
    return [(p._param_fqn, tuple(p.padded_sharded_param_size), str(p.orig_dtype)) for p in group.fsdp_params]


def reduce_dtype(group: Any) -> torch.dtype | None:
    """dtype of the reduce-scatter buffers, as ``foreach_reduce`` picks it; None without trainable params."""
    params = trainable_params(group)
    if not params:
        return None
    return group._reduce_dtype or params[0].param_dtype or params[0].orig_dtype


def orig_dtype(group: Any) -> torch.dtype | None:
    return group._orig_dtype


def reduce_scatter_numel(group: Any) -> int:
    """Elements of one rank's row of the reduce-scatter input (= size of the owner's accumulator)."""
    return sum(p.padded_sharded_param_size.numel() for p in trainable_params(group))


def all_gather_input(group: Any) -> torch.Tensor:
    """This rank's all-gather input for ``group``, flat, exactly as FSDP2 copies it in.

    Mixed-dtype groups are sent as bytes (uint8), as ``foreach_all_gather`` does.
    """
    for p in group.fsdp_params:
        if p.sharded_state != ShardedState.SHARDED:
            raise RuntimeError(
                f"ODC publishes shards after the optimizer step, but {p._param_fqn} is {p.sharded_state}; "
                "keep the default reshard_after_backward=True"
            )
    inputs = _get_param_all_gather_inputs(fsdp_params=group.fsdp_params)
    _, _, dtype = _get_all_gather_input_metadatas(param_all_gather_inputs=inputs)
    flat = [(t.view(torch.uint8) if dtype == torch.uint8 else t).reshape(-1) for ts in inputs for t in ts]
    return torch.cat(flat)


def postdivide_factor(group: Any) -> float | None:
    """What FSDP2 divides the summed reduce-scatter output by (sum reduction forced on)."""
    _, post, _, _ = _get_gradient_divide_factors(
        reduce_scatter_group=shard_group(group),
        all_reduce_group=None,
        reduce_dtype=reduce_dtype(group),
        device_type=group.device.type,
        factor=group.gradient_divide_factor,
        force_sum_reduction_for_comms=True,
    )
    return post


def fold_into_grads(group: Any, reduce_output: torch.Tensor) -> None:
    """Apply FSDP2's post-reduce-scatter processing to ``reduce_output`` (this rank's summed slice).

    Mirrors ``foreach_reduce`` after the collective: postdivide, cast to the original dtype, split
    per parameter with ``as_strided`` and ``+=`` into (or create) ``sharded_param.grad``.
    ``reduce_output`` must be fresh memory: new gradients become views of it, as in FSDP2.
    """
    post = postdivide_factor(group)
    if post is not None and post != 1:
        reduce_output.div_(post)
    dtype = orig_dtype(group)
    if dtype is not None and reduce_output.dtype != dtype:
        reduce_output = reduce_output.to(dtype)
    offset = 0
    for p in trainable_params(group):
        new_grad = torch.as_strided(
            reduce_output, size=p.sharded_size, stride=p.contiguous_sharded_stride, storage_offset=offset
        )
        if p.sharded_param.grad is not None:
            p.sharded_param.grad._local_tensor += new_grad
        else:
            p.sharded_param.grad = p.to_sharded_dtensor(tensor=new_grad)
        offset += p.padded_sharded_param_size.numel()


def get_comms(group: Any) -> tuple[Any, Any]:
    return group._all_gather_comm, group._reduce_scatter_comm


def set_comms(group: Any, all_gather: Any, reduce_scatter: Any) -> None:
    """Install comm objects directly on a param group (used to restore FSDP2's defaults at close)."""
    group._all_gather_comm = all_gather
    group._reduce_scatter_comm = reduce_scatter


def sum_and_unused_flags(group: Any) -> tuple[bool, bool]:
    return group.force_sum_reduction_for_comms, group.reduce_scatter_unused_params


def set_sum_and_unused_flags(group: Any, force_sum: bool, unused: bool) -> None:
    group.force_sum_reduction_for_comms = force_sum
    group.reduce_scatter_unused_params = unused


def version_warning() -> str | None:
    """A warning if the installed torch is not a tested version, else None."""
    return untested_warning(_LIBRARY)


# ----------------------------------------------------------------- teardown
# Where torch keeps a ProcessGroup alive after destroy_process_group(): a DeviceMesh's registry (shared by a root
# mesh and the meshes sliced or flattened from it) and FSDP2's per-group mesh infos.
_MESH_ATTRS = ("_pg_registry", "_root_mesh", "_flatten_mapping")
_MESH_INFO_PG_ATTRS = ("shard_process_group", "replicate_process_group", "reduce_scatter_process_group")


def release_process_groups(meshes: list[Any]) -> int:
    """Drop the references that every live FSDP2 module, and ``meshes``, keep to process groups.

    Call only after ``destroy_process_group()`` destroyed every group: no FSDP2 module can communicate afterwards.
    gloo joins its worker threads only when its group object is freed (its ``shutdown()`` leaves them running), and a
    worker still running while the interpreter finalises can abort the process at exit.

    Returns:
        `int`: how many references were dropped.
    """
    from torch.distributed.tensor import DTensor

    todo, infos = list(meshes), {}
    for module in list(_module_state_mapping.keys()):
        if not is_fsdp2(module):
            continue
        todo += [p.device_mesh for p in module.parameters() if isinstance(p, DTensor)]
        for group in param_groups(fsdp_state(module)):
            for info in (group.mesh_info, group.post_forward_mesh_info):
                if info is not None:
                    infos[id(info)] = info
    dropped = 0
    for info in infos.values():
        todo.append(info.mesh)
        for attr in _MESH_INFO_PG_ATTRS:
            if getattr(info, attr, None) is not None:
                setattr(info, attr, None)
                dropped += 1
    seen: set[int] = set()
    while todo:
        mesh = todo.pop()
        if mesh is None or id(mesh) in seen:
            continue
        seen.add(id(mesh))
        for attr in _MESH_ATTRS:
            _require(mesh, attr, "DeviceMesh")
        todo.append(mesh._root_mesh)
        todo.extend(mesh._flatten_mapping.values())
        dropped += len(mesh._pg_registry)
        mesh._pg_registry.clear()
    return dropped


# ----------------------------------------------------------------- symmetric memory (the CUDA transport)
_SYMM = "torch.distributed._symmetric_memory"


def _symmetric_memory() -> tuple[Any, Any]:
    """``empty`` and ``rendezvous`` of torch's symmetric memory, with the handle's ``get_buffer``, checked."""
    empty = _import(_SYMM, "empty")
    rendezvous = _import(_SYMM, "rendezvous")
    handle_type = _import(_SYMM, "_SymmetricMemory")
    get_buffer = _require(handle_type, "get_buffer", f"{_SYMM}._SymmetricMemory")
    _check_signature(empty, ("dtype", "device"), f"{_SYMM}.empty")
    _check_signature(rendezvous, ("tensor", "group"), f"{_SYMM}.rendezvous")
    _check_signature(get_buffer, ("rank", "sizes", "dtype", "storage_offset"), f"{_SYMM}._SymmetricMemory.get_buffer")
    return empty, rendezvous


def symmetric_memory_unavailable_reason() -> str | None:
    """Why this torch's symmetric memory cannot serve the CUDA transport (a sentence naming what is missing), or
    None if it can. Does not touch a GPU."""
    try:
        _symmetric_memory()
    except CompatError as err:
        return str(err).rstrip(".")  # callers embed it in a sentence
    return None


def symmetric_segment(nbytes: int, device: torch.device) -> torch.Tensor:
    """A 1-D uint8 tensor of ``nbytes`` in symmetric memory on ``device`` (collective with `symmetric_rendezvous`)."""
    empty, _ = _symmetric_memory()
    return empty(nbytes, dtype=torch.uint8, device=device)  # `size` is variadic: the one positional argument


def symmetric_rendezvous(segment: torch.Tensor, group: Any) -> Any:
    """Collective: exchange the ``segment`` handles of every rank of ``group``; returns the handle for peer views."""
    _, rendezvous = _symmetric_memory()
    return rendezvous(tensor=segment, group=group)


def peer_segment(handle: Any, peer: int, nbytes: int) -> torch.Tensor:
    """``peer``'s segment (``nbytes`` uint8 bytes), mapped into this process by a `symmetric_rendezvous` handle."""
    return handle.get_buffer(rank=peer, sizes=(nbytes,), dtype=torch.uint8, storage_offset=0)
