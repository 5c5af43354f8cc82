"""Every torch internal that odc_accelerate reads or calls, in one place, checked against the installed torch.

The official hooks (``set_custom_all_gather`` / ``set_custom_reduce_scatter``) carry the per-layer data path, but
reproducing FSDP2's gradient post-processing exactly at the step boundary, and publishing shards outside an
all-gather, needs a few private pieces of FSDP2; the CUDA transport needs torch's private symmetric memory. The FSDP2
functions, and the parameters they are called with (always by keyword), are checked when this module is imported;
:func:`check` verifies the attributes read on live FSDP2 objects at engine start. Each raises
:class:`~odc_accelerate._compat.CompatError` naming whatever is missing, so a torch upgrade fails loudly at start-up
instead of training wrongly. The tested torch versions are ``TESTED["torch"]`` in :mod:`odc_accelerate._compat`.

Where the supported releases differ, `PATHS` says which internal each one has; it is read once, from the installed
torch's version, and every function below that touches such an internal follows it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from . import CompatError, check_signature, import_attr, patch_attribute, require, version_tuple

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


# ----------------------------------------------------------------- what differs between the supported releases
@dataclass(frozen=True)
class _Path:
    """One FSDP2 internal that the supported torch releases do not all have: the first release with it, and what the
    older ones do instead."""

    internal: str
    since: tuple[int, int]
    before: str


#: The FSDP2 internals whose presence differs between the supported releases (torch 2.11 to 2.15).
PATHS: dict[str, _Path] = {
    "param_groups": _Path(
        "FSDPState._fsdp_param_groups",
        (2, 12),
        "one `FSDPState._fsdp_param_group` per state (None without parameters)",
    ),
    "reduce_scatter_unused_params": _Path(
        "FSDPModule.set_reduce_scatter_unused_params",
        (2, 13),
        "a param group's reduce-scatter holds only the params that got a gradient; the engine reads which from "
        "`foreach_reduce`'s `fsdp_params` and places each one's rows at its own offset",
    ),
    "reduce_scatter_process_group": _Path(
        "FSDPMeshInfo.reduce_scatter_process_group",
        (2, 13),
        "the mesh info holds `shard_process_group` only",
    ),
    "grad_dtypes": _Path(
        "FSDPParam.sharded_grad_dtype",
        (2, 15),
        "every reduced gradient of a param group is cast to the group's `FSDPParamGroup._orig_dtype`, and the "
        "reduce dtype is the group's `_reduce_dtype`, else the params' compute dtype",
    ),
    "reduce_scatter_order": _Path(
        "FSDPParamGroup._reduce_scatter_param_indices",
        (2, 15),
        "a reduce-scatter holds the group's params in their `fsdp_params` order",
    ),
    "grad_accumulates_in_leaf": _Path(
        "FSDPParam.unsharded_accumulated_grad as the unsharded param's own .grad (read-only)",
        (2, 15),
        "a gradient kept without reduce-scatter moves to `FSDPParam.unsharded_accumulated_grad` in the reduce dtype, "
        "and FSDP2 gives a param without a gradient zeros in the compute dtype when it reduces",
    ),
}

#: ``(major, minor)`` of the installed torch; every `PATHS` choice is made from it.
TORCH_VERSION: tuple[int, int] = version_tuple(torch.__version__)


def has(feature: str) -> bool:
    """Whether the installed torch has the `PATHS` internal ``feature`` (decided by its version)."""
    return TORCH_VERSION >= PATHS[feature].since


#: The oldest torch the engine runs on: older releases lack FSDP2 pieces it cannot do without (the comm hooks of
#: ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` and ``set_force_sum_reduction_for_comms`` as 2.11 has
#: them) or were never tested.
MIN_TORCH: tuple[int, int] = (2, 11)

# Public FSDPModule methods the engine calls: present from MIN_TORCH on, checked at engine start all the same.
_MODULE_METHODS = ("set_force_sum_reduction_for_comms", "set_custom_all_gather", "set_custom_reduce_scatter")


def check_torch_release() -> None:
    """Raise :class:`~odc_accelerate._compat.CompatError` if the installed torch is older than `MIN_TORCH`, naming the
    release and what it lacks."""
    if TORCH_VERSION < MIN_TORCH:
        missing = [f"FSDPModule.{m}" for m in _MODULE_METHODS if not hasattr(FSDPModule, m)]
        what = f"lacks {', '.join(missing)}" if missing else "was not tested (its FSDP2 internals differ)"
        raise CompatError(
            f"ODCEngine needs torch {MIN_TORCH[0]}.{MIN_TORCH[1]} or newer: torch {torch.__version__} {what}. "
            "Install a supported torch (the range in odc_accelerate's pyproject.toml)."
        )


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


# ----------------------------------------------------------------- what a rank keeps unsharded through a step
# The step memory policy (`odc_accelerate.memory`) sets FSDP2's own per-group switches: `post_forward_mesh_info`
# (None: no reshard after forward, as `set_reshard_after_forward(False)`), `reshard_after_backward` (as
# `set_reshard_after_backward`) and `reduce_grads` / `all_reduce_grads` (as `set_requires_gradient_sync`), per group
# rather than per module tree. Kept gradients are reduced through FSDP2's own `post_backward` at the step boundary.
_KEEP_GROUP_ATTRS = (
    "post_forward_mesh_info",
    "reshard_after_backward",
    "reduce_grads",
    "all_reduce_grads",
    "is_unsharded",
    "post_backward",
    "finalize_backward",
    "reshard",
    "comm_ctx",
    "_training_state",
)
# `_unsharded_param` is created at a param's first unshard: read with a default.
_KEEP_PARAM_ATTRS = ("unsharded_accumulated_grad", "reduce_dtype")


@dataclass(frozen=True)
class KeepFlags:
    """A param group's FSDP2 switches that the memory policy changes (saved at engine start, restored at close)."""

    post_forward_mesh_info: Any
    reshard_after_backward: bool
    reduce_grads: bool
    all_reduce_grads: bool


def check_keep_support(group: Any) -> None:
    """Raise :class:`~odc_accelerate._compat.CompatError` if ``group`` lacks an internal the memory policy uses."""
    for attr in _KEEP_GROUP_ATTRS:
        _require(group, attr, "FSDPParamGroup")
    if not (hasattr(group.comm_ctx, "reduce_scatter_states") or hasattr(group.comm_ctx, "reduce_scatter_state")):
        raise CompatError(
            f"torch {torch.__version__}: FSDPCommContext has neither reduce_scatter_states nor reduce_scatter_state; "
            "the memory policy cannot release a kept gradient's reduce-scatter buffer. Use memory_policy='neither'."
        )
    for p in group.fsdp_params[:1]:
        for attr in _KEEP_PARAM_ATTRS:
            _require(p, attr, "FSDPParam")


def keep_flags(group: Any) -> KeepFlags:
    return KeepFlags(
        group.post_forward_mesh_info, group.reshard_after_backward, group.reduce_grads, group.all_reduce_grads
    )


def set_keep(group: Any, saved: KeepFlags, keep_params: bool, keep_grads: bool) -> None:
    """Make ``group`` keep its gathered params (no reshard after forward or backward) and / or its unsharded grads
    (no reduce after backward); what is not kept goes back to ``saved`` (the user's own settings)."""
    group.post_forward_mesh_info = None if keep_params else saved.post_forward_mesh_info
    group.reshard_after_backward = False if keep_params else saved.reshard_after_backward
    group.reduce_grads = False if keep_grads else saved.reduce_grads
    group.all_reduce_grads = False if keep_grads else saved.all_reduce_grads


def gathers_per_microbatch(group: Any, saved: KeepFlags) -> int:
    """How many times one forward + backward gathers ``group`` with the user's settings: 2 when it reshards after
    forward (gathered again for backward), else 1."""
    return 2 if saved.post_forward_mesh_info is not None else 1


def is_unsharded(group: Any) -> bool:
    return bool(group.is_unsharded)


def reshard(group: Any) -> None:
    """Free ``group``'s gathered parameters (FSDP2 registers the sharded ones on the modules again)."""
    group.reshard()


def has_pending_grads(group: Any) -> bool:
    """Whether ``group`` holds unsharded gradients that no reduce-scatter has taken yet."""
    return any(
        p.unsharded_accumulated_grad is not None
        or getattr(getattr(p, "_unsharded_param", None), "grad", None) is not None
        for p in group.fsdp_params
    )


def reduce_pending_grads(group: Any) -> None:
    """Reduce ``group``'s kept unsharded gradients now, through FSDP2's own post-backward path (its reduce-scatter
    hook runs inside), then release what that path keeps for overlap (the reduce-scatter input)."""
    if not has("grad_accumulates_in_leaf") and any(
        p.unsharded_accumulated_grad is not None for p in group.fsdp_params
    ):
        # Gradients were kept in the reduce dtype (it differs from the compute dtype). FSDP2 would add zeros in the
        # compute dtype for params without a gradient, and refuses to reduce mixed dtypes: give them reduce-dtype zeros.
        # (torch 2.15+ accumulates in each param's gradient dtype and gives unused params zeros of that dtype.)
        for p in group.fsdp_params:
            unsharded = getattr(p, "_unsharded_param", None)
            if (
                unsharded is not None
                and p.sharded_param.requires_grad
                and p.unsharded_accumulated_grad is None
                and unsharded.grad is None
            ):
                p.unsharded_accumulated_grad = torch.zeros(
                    unsharded.shape, dtype=p.reduce_dtype, device=unsharded.device
                )
    saved = group.reduce_grads, group.all_reduce_grads, group.reshard_after_backward
    group.reduce_grads = group.all_reduce_grads = True
    group.reshard_after_backward = False  # parameters are the caller's to drop
    before = len(group.comm_ctx.reduce_scatter_states) if hasattr(group.comm_ctx, "reduce_scatter_states") else 0
    try:
        group.post_backward()
        group.finalize_backward()
    finally:
        group.reduce_grads, group.all_reduce_grads, group.reshard_after_backward = saved
        group._training_state = type(group._training_state).IDLE
        if hasattr(group.comm_ctx, "reduce_scatter_states"):
            states = group.comm_ctx.reduce_scatter_states
            for rs_state in states[before:]:
                if rs_state.event is not None:
                    group.device_handle.current_stream().wait_event(rs_state.event)
            del states[before:]
        else:
            group.comm_ctx.reduce_scatter_state = None


# ----------------------------------------------------------------- the reduce-scatter layout
# torch 2.13+: `set_reduce_scatter_unused_params(True)` makes every reduce-scatter of a group hold all its trainable
# params (zeros for those without a gradient), the accumulator's layout. torch 2.11 and 2.12 have no such switch: a
# reduce-scatter holds only the params that got a gradient in that backward, which `foreach_reduce` receives as
# `fsdp_params`. There the call's params are recorded (per thread: backward may run on several) for the hook,
# which runs inside that very call.
_reduce_call = threading.local()
_PARAM_GROUP_MODULE = f"{_FSDP}._fsdp_param_group"


#: Set to True on a reduce-scatter hook whose HSDP all-reduce the engine runs itself, once per optimizer step.
DEFERS_ALL_REDUCE = "odc_defers_all_reduce"
_HSDP_PARAMS = ("all_reduce_grads", "partial_reduce_output")


def _record_reduce_params(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def foreach_reduce(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        comm = bound.arguments["reduce_scatter_comm"]
        if getattr(comm, DEFERS_ALL_REDUCE, False):
            # HSDP under ODC: no per-microbatch all-reduce across replicas (it would pair ranks microbatch by
            # microbatch). ``set_requires_gradient_sync(True)`` (accelerate's no_sync exit) turns FSDP2's
            # all_reduce_grads back on, so the flag is forced here, where FSDP2 reads it, not once at set-up. No
            # partial output is carried: the hook's output is zeros.
            bound.arguments["all_reduce_grads"] = False
            bound.arguments["partial_reduce_output"] = None
        previous = getattr(_reduce_call, "current", None)
        _reduce_call.current = (comm, list(bound.arguments["fsdp_params"]))
        try:
            return original(*bound.args, **bound.kwargs)
        finally:
            _reduce_call.current = previous

    return foreach_reduce


def fix_reduce_scatter_layout(module: nn.Module, *, defer_all_reduce: bool = False) -> None:
    """Make the reduce-scatter layout of ``module``'s param group knowable to the engine's hook.

    With ``set_reduce_scatter_unused_params`` (torch 2.13+) every reduce-scatter holds all trainable params; on
    torch 2.11 and 2.12 FSDP2's ``foreach_reduce`` is wrapped (once per process) to record which params each call
    holds, read by `reduce_scatter_spans`. The wrapper only records its arguments; FSDP2 runs unchanged.

    With ``defer_all_reduce`` (an HSDP mesh) the wrapper is installed on every release: for reduce-scatter hooks
    marked `DEFERS_ALL_REDUCE` it turns off FSDP2's per-microbatch all-reduce across replicas.
    """
    if has("reduce_scatter_unused_params"):
        module.set_reduce_scatter_unused_params(True, recurse=False)
        if not defer_all_reduce:
            return
    group_module = importlib.import_module(_PARAM_GROUP_MODULE)
    original = _require(group_module, "foreach_reduce", _PARAM_GROUP_MODULE)
    params = ("fsdp_params", "reduce_scatter_comm", *(_HSDP_PARAMS if defer_all_reduce else ()))
    _check_signature(original, params, f"{_PARAM_GROUP_MODULE}.foreach_reduce")
    patch_attribute(group_module, "foreach_reduce", _record_reduce_params, library=_LIBRARY, where=_PARAM_GROUP_MODULE)


def reduce_scatter_spans(group: Any, comm: Any) -> list[tuple[int, int, int]] | None:
    """Where each row segment of the reduce-scatter now running through ``comm`` belongs in the accumulator.

    Returns None when the reduce-scatter has the accumulator's layout (always with ``reduce_scatter_unused_params``),
    else ``(offset in the row, offset in the accumulator, numel)`` per param it holds, in row order.

    Raises:
        RuntimeError: before torch 2.13, called outside a ``foreach_reduce`` of ``comm`` (the hook is then not called
            by FSDP2 as recorded, and the layout cannot be known).
    """
    if has("reduce_scatter_unused_params"):
        return None
    current = getattr(_reduce_call, "current", None)
    if current is None or current[0] is not comm:
        raise RuntimeError(
            f"ODC could not tell which params the reduce-scatter of {group_fqn(group)} holds: on torch "
            f"{torch.__version__} it reads them from FSDP2's foreach_reduce, which did not run this hook. "
            "Construct ODCEngine before the first backward and do not replace FSDP2's reduce-scatter hook."
        )
    params = current[1]
    full = trainable_params(group)
    if [id(p) for p in params] == [id(p) for p in full]:
        return None
    offsets, offset = {}, 0
    for p in full:
        offsets[id(p)] = offset
        offset += p.padded_sharded_param_size.numel()
    spans, row_offset = [], 0
    for p in params:
        if id(p) not in offsets:
            raise RuntimeError(
                f"ODC reduce-scatter for {group_fqn(group)}: {p._param_fqn} got a gradient but did not require grad "
                "when ODCEngine was built; set requires_grad before constructing ODCEngine"
            )
        numel = p.padded_sharded_param_size.numel()
        spans.append((row_offset, offsets[id(p)], numel))
        row_offset += numel
    return spans


def default_store() -> Any:
    """The key-value store of the default process group (private ``distributed_c10d._get_default_store``; every rank
    of the job reaches it): HSDP's failure notes, and the ``dynamic`` plan's claim counter where a transport has none
    of its own (`transport.claims`)."""
    get_store = _import("torch.distributed.distributed_c10d", "_get_default_store")
    return get_store()


# ----------------------------------------------------------------- teardown
# Where torch keeps a ProcessGroup alive after destroy_process_group(): a DeviceMesh's registry (shared by a root
# mesh and the meshes sliced or flattened from it) and FSDP2's per-group mesh infos.
_MESH_ATTRS = ("_pg_registry", "_root_mesh", "_flatten_mapping")
_MESH_INFO_PG_ATTRS = (
    "shard_process_group",
    "replicate_process_group",
    *(("reduce_scatter_process_group",) if has("reduce_scatter_process_group") else ()),
)


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
#: torch's switch that keeps a symmetric-memory rendezvous from binding NVLS multicast (ODC never uses it)
MULTICAST_OFF_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"


def _symmetric_memory() -> Any:
    """torch's ``_SymmetricMemory`` class, with every method the CUDA transport calls checked."""
    _check_signature(_import(_SYMM, "rendezvous"), ("tensor", "group"), f"{_SYMM}.rendezvous")
    handle_type = _import(_SYMM, "_SymmetricMemory")
    where = f"{_SYMM}._SymmetricMemory"
    empty_p2p = _require(handle_type, "empty_strided_p2p", where)
    get_buffer = _require(handle_type, "get_buffer", where)
    _check_signature(empty_p2p, ("size", "stride", "dtype", "device", "group_name"), f"{where}.empty_strided_p2p")
    _check_signature(get_buffer, ("rank", "sizes", "dtype", "storage_offset"), f"{where}.get_buffer")
    return handle_type


def symmetric_memory_unavailable_reason() -> str | None:
    """Why this torch's symmetric memory cannot serve the CUDA transport (a sentence naming what is missing), or
    None if it can. Does not touch a GPU."""
    try:
        _symmetric_memory()
    except CompatError as err:
        return str(err).rstrip(".")  # callers embed it in a sentence
    return None


def symmetric_signal_pad_bytes() -> int | None:
    """The signal pad torch's symmetric memory allocates with each segment (``get_signal_pad_size``), or `None` where
    this torch does not say (the caller then counts an upper bound)."""
    import importlib

    get_size = getattr(importlib.import_module(_SYMM), "get_signal_pad_size", None)
    return int(get_size()) if callable(get_size) else None


def symmetric_backend(device: torch.device) -> str:
    """The symmetric-memory backend this process allocates with on ``device`` (``"CUDA"``, ``"NCCL"``, ...).

    Both torch's answer (``get_backend``, set by ``set_backend`` or FSDP2's ``set_symm_mem``; absent on some releases)
    and ``$TORCH_SYMMMEM`` (read when the first block is allocated) are consulted; whichever names a backend other than
    CUDA wins, so that a refusal errs on the safe side. torch's default is CUDA.
    """
    import os  # local: the top of this module is shared with other sections

    get_backend = getattr(_symmetric_memory(), "get_backend", None)
    named = [get_backend(device) if get_backend is not None else None, os.environ.get("TORCH_SYMMMEM")]
    others = [str(b) for b in named if b and str(b).upper() != "CUDA"]
    return others[0] if others else "CUDA"


def _without_multicast(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with NVLS multicast disabled for symmetric memory (torch reads the switch at allocation and
    rendezvous).

    The variable is written at most once per process and left set: by now NCCL and gloo threads run and may call
    ``getenv``, and a ``setenv`` racing them is undefined behaviour in glibc, so writing it again to restore the old
    value would double that risk. When it is already ``1`` (e.g. set by the launcher), nothing is written.
    """
    import os

    if os.environ.get(MULTICAST_OFF_ENV) != "1":
        os.environ[MULTICAST_OFF_ENV] = "1"
    return fn()


def symmetric_segment(nbytes: int, device: torch.device, group: Any) -> torch.Tensor:
    """A 1-D uint8 tensor of ``nbytes`` in symmetric memory on ``device`` for ``group`` (whose ranks then call
    `symmetric_rendezvous` with it).

    Allocated directly (``empty_strided_p2p``), not through ``_symmetric_memory.empty``: in recent releases (2.13
    checked) ``empty`` allocates from a per-device memory pool that keeps freed blocks cached, so the segment would
    outlive the transport. Allocated directly, it goes back to the driver when its last view dies.
    """
    handle_type = _symmetric_memory()
    group_name = group if isinstance(group, str) else group.group_name  # required by some releases, harmless in others
    return _without_multicast(
        lambda: handle_type.empty_strided_p2p(
            size=(nbytes,), stride=(1,), dtype=torch.uint8, device=device, group_name=group_name
        )
    )


def symmetric_rendezvous(segment: torch.Tensor, group: Any) -> Any:
    """Collective: exchange the ``segment`` handles of every rank of ``group``; returns the handle for peer views.

    Multicast is not bound (ODC reads and adds peer to peer only; binding NVLS for a large segment costs set-up time
    and multicast memory).
    """
    _symmetric_memory()
    rendezvous = _import(_SYMM, "rendezvous")  # the module function: it does whatever set-up this release needs
    return _without_multicast(lambda: rendezvous(tensor=segment, group=group))


def peer_segment(handle: Any, peer: int, nbytes: int) -> torch.Tensor:
    """``peer``'s segment (``nbytes`` uint8 bytes), mapped into this process by a `symmetric_rendezvous` handle."""
    return handle.get_buffer(rank=peer, sizes=(nbytes,), dtype=torch.uint8, storage_offset=0)


# ----------------------------------------------------------------- dispatcher modes (the tests' communication counter)
def torch_dispatch_mode() -> type:
    """torch's ``TorchDispatchMode`` (private ``torch.utils._python_dispatch``): the base class of a mode that sees
    every op the dispatcher runs, as the test helpers' communication counter does."""
    return _import("torch.utils._python_dispatch", "TorchDispatchMode")
