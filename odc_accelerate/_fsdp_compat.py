"""Every FSDP2 internal that odc_accelerate reads or calls, in one place, checked against the installed torch.

The official hooks (``set_custom_all_gather`` / ``set_custom_reduce_scatter``) carry the per-layer
data path, but reproducing FSDP2's gradient post-processing exactly at the step boundary, and
publishing shards outside an all-gather, needs a few private pieces. :func:`check` verifies them
all at engine start and raises :class:`FSDPCompatError` naming whatever is missing, so a torch
upgrade fails loudly at start-up instead of training wrongly.

Tested against torch 2.13.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

TESTED_TORCH = ((2, 13),)


class FSDPCompatError(RuntimeError):
    """The installed torch lacks an FSDP2 internal that ODC relies on."""


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _import(path: str, attr: str) -> Any:
    import importlib

    try:
        module = importlib.import_module(path)
    except ImportError as err:
        raise FSDPCompatError(_missing(f"module {path}")) from err
    if not hasattr(module, attr):
        raise FSDPCompatError(_missing(f"{path}.{attr}"))
    return getattr(module, attr)


def _missing(what: str) -> str:
    tested = ", ".join(f"{a}.{b}" for a, b in TESTED_TORCH)
    return (
        f"odc_accelerate needs the FSDP2 internal `{what}`, which torch {torch.__version__} does not have "
        f"(tested with torch {tested}). Install a supported torch or upgrade odc_accelerate."
    )


_FSDP = "torch.distributed.fsdp._fully_shard"
FSDPModule = _import("torch.distributed.fsdp", "FSDPModule")
AllGather = _import(f"{_FSDP}._fsdp_api", "AllGather")
ReduceScatter = _import(f"{_FSDP}._fsdp_api", "ReduceScatter")
FSDPMeshInfo = _import(f"{_FSDP}._fsdp_common", "FSDPMeshInfo")
HSDPMeshInfo = _import(f"{_FSDP}._fsdp_common", "HSDPMeshInfo")
DDPMeshInfo = _import(f"{_FSDP}._fsdp_common", "DDPMeshInfo")
ShardedState = _import(f"{_FSDP}._fsdp_param", "ShardedState")
CPUOffloadPolicy = _import("torch.distributed.fsdp", "CPUOffloadPolicy")
_get_param_all_gather_inputs = _import(f"{_FSDP}._fsdp_collectives", "_get_param_all_gather_inputs")
_get_all_gather_input_metadatas = _import(f"{_FSDP}._fsdp_collectives", "_get_all_gather_input_metadatas")
_get_gradient_divide_factors = _import(f"{_FSDP}._fsdp_collectives", "_get_gradient_divide_factors")
_module_state_mapping = _import("torch.distributed._composable_state", "_module_state_mapping")

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

    Raises :class:`FSDPCompatError` naming the first missing piece.
    """
    groups = [g for _, s in all_states(model) for g in s._fsdp_param_groups]
    if groups:
        for attr in _GROUP_ATTRS:
            if not hasattr(groups[0], attr):
                raise FSDPCompatError(_missing(f"FSDPParamGroup.{attr}"))
        params = [p for g in groups for p in g.fsdp_params]
        if params:
            for attr in _PARAM_ATTRS:
                if not hasattr(params[0], attr):
                    raise FSDPCompatError(_missing(f"FSDPParam.{attr}"))


def is_fsdp2(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def fsdp_state(module: nn.Module) -> Any:
    if not hasattr(module, "_get_fsdp_state"):
        raise FSDPCompatError(_missing("FSDPModule._get_fsdp_state"))
    return module._get_fsdp_state()


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
        if not hasattr(state, attr):
            raise FSDPCompatError(_missing(f"FSDPState.{attr}"))
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


def reduce_dtype(group: Any) -> torch.dtype | None:
    """dtype of the reduce-scatter buffers, as ``foreach_reduce`` picks it; None without trainable params."""
    params = trainable_params(group)
    if not params:
        return None
    return group._reduce_dtype or params[0].param_dtype or params[0].orig_dtype


def orig_dtype(group: Any) -> torch.dtype | None:
    return group._orig_dtype


def reduce_scatter_numel(group: Any, world_size: int) -> int:
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
    inputs = _get_param_all_gather_inputs(group.fsdp_params)
    _, _, dtype = _get_all_gather_input_metadatas(inputs)
    flat = [(t.view(torch.uint8) if dtype == torch.uint8 else t).reshape(-1) for ts in inputs for t in ts]
    return torch.cat(flat)


def postdivide_factor(group: Any, world_size: int) -> float | None:
    """What FSDP2 divides the summed reduce-scatter output by (sum reduction forced on)."""
    dtype = reduce_dtype(group)
    pg = shard_group(group)
    _, post, _, _ = _get_gradient_divide_factors(
        pg, None, dtype, group.device.type, group.gradient_divide_factor, True
    )
    return post


def fold_into_grads(group: Any, reduce_output: torch.Tensor, world_size: int) -> None:
    """Apply FSDP2's post-reduce-scatter processing to ``reduce_output`` (this rank's summed slice).

    Mirrors ``foreach_reduce`` after the collective: postdivide, cast to the original dtype, split
    per parameter with ``as_strided`` and ``+=`` into (or create) ``sharded_param.grad``.
    ``reduce_output`` must be fresh memory: new gradients become views of it, as in FSDP2.
    """
    post = postdivide_factor(group, world_size)
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
            p.sharded_param.grad = p.to_sharded_dtensor(new_grad)
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
    if _torch_version() not in TESTED_TORCH:
        return f"odc_accelerate was tested with torch 2.13; torch {torch.__version__} is untested"
    return None


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
            if not hasattr(mesh, attr):
                raise FSDPCompatError(_missing(f"DeviceMesh.{attr}"))
        todo.append(mesh._root_mesh)
        todo.extend(mesh._flatten_mapping.values())
        dropped += len(mesh._pg_registry)
        mesh._pg_registry.clear()
    return dropped
