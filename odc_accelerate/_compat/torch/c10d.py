"""torch.distributed's process groups: the default group's key-value store, and the release, at teardown, of the
references that FSDP2 modules and device meshes keep to groups already destroyed.
"""

from __future__ import annotations

from typing import Any

from . import _import, _require, has
from .fsdp import _module_state_mapping, fsdp_state, is_fsdp2, param_groups


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
