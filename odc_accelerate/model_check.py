"""Set-up checks of an FSDP2 model before `ODCEngine` serves it.

Every check here runs before the engine's first collective, and a refusal found on some ranks only is raised on
every rank (`agree_on_model`): a rank that raised alone would leave its peers waiting in the next collective.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.nn as nn

from ._compat import fsdp as compat

#: A served FSDP2 param group and the module whose ``fully_shard`` call made it.
Entry = tuple[nn.Module, Any]


def served_groups(model: nn.Module) -> tuple[list[Entry], str | None]:
    """The (module, param group) pairs ODC serves, and the first reason to refuse the model (``None`` if usable).

    Never raises for an unsupported model, so that the reason can first be shared with the other ranks.
    """
    try:
        return _entries(model), None
    except ValueError as err:
        return [], str(err)


def _entries(model: nn.Module) -> list[Entry]:
    entries: list[Entry] = []
    for module, state in compat.all_states(model):
        groups = compat.param_groups(state)
        if len(groups) > 1:
            raise ValueError(
                f"ODC supports one param group per fully_shard call, but {type(module).__name__} has "
                f"{len(groups)} (from shard_placement_fn with per-param meshes); shard it with one mesh"
            )
        for group in groups:
            fqn = compat.group_fqn(group)
            if (problem := compat.mesh_problem(group)) is not None:
                raise ValueError(problem)
            if compat.uses_hpz(group):
                raise ValueError(
                    f"ODC does not support reshard_after_forward as an int (HPZ) yet; {fqn} uses it. "
                    "Use reshard_after_forward=True or False."
                )
            if compat.offloads(group):
                raise ValueError(f"ODC does not support CPUOffloadPolicy yet; {fqn} uses it. Remove offload_policy.")
            if (problem := compat.reduce_dtype_problem(group)) is not None:
                raise ValueError(problem)
            entries.append((module, group))
    if not entries:
        raise ValueError("the FSDP2 model has no parameters to shard; nothing for ODC to do")
    # ODC replaces FSDP2's collectives, so the process group objects themselves need not be one: what must agree is
    # who the peers are and in which order (a shard's owner is its rank in the group). Several groups over the same
    # ranks are what torch builds for each `fully_shard` without `mesh=` under a gloo default group on a CUDA
    # machine (e.g. `--ddp_backend gloo`).
    layouts = {(_ranks(compat.shard_group(g)), _ranks(compat.replicate_group(g))) for _, g in entries}
    if len(layouts) != 1:
        described = "; ".join(
            f"shard ranks {list(shard)}" + (f", replicate ranks {list(rep)}" if rep else "")
            for shard, rep in sorted(layouts)
        )
        raise ValueError(
            "ODC needs every fully_shard call to shard over the same ranks in the same order, but the model's param "
            f"groups use different process groups ({described}). Pass one DeviceMesh to every fully_shard call "
            "(e.g. DeviceMesh.from_group(dist.group.WORLD, device_type)), or, under accelerate, set a "
            "parallelism_config (or use the NCCL backend on GPUs, whose default mesh is shared)."
        )
    return entries


def _ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of ``group`` in group-rank order (empty for no group)."""
    return () if group is None else tuple(dist.get_process_group_ranks(group))


def agree_on_model(entries: list[Entry], problem: str | None, group: Any = None) -> None:
    """Raise on every rank of ``group`` if any rank refused the model or built different groups.

    Collective over ``group``. All ranks must build the same groups in the same order, or reads would mix layers.
    """
    signature = [(compat.group_fqn(g), compat.group_layout(g), str(compat.reduce_dtype(g))) for _, g in entries]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (signature, problem), group=group)
    rank = dist.get_rank(group)
    problems = [(r, p) for r, (_, p) in enumerate(gathered) if p is not None]
    if problems:
        first, text = problems[0]
        raise ValueError(text if first == rank else f"rank {first} refused the model: {text}")
    signatures = [s for s, _ in gathered]
    different = [r for r, s in enumerate(signatures) if s != signatures[0]]
    if different:
        first_different = signatures[different[0]]
        where = next(
            (
                f"group {i} ({a[0]} vs {b[0]})"
                for i, (a, b) in enumerate(zip(signatures[0], first_different, strict=False))
                if a != b
            ),
            f"the number of groups ({len(signatures[0])} vs {len(first_different)})",
        )
        raise ValueError(
            f"ODC needs the same FSDP2 model on every rank, but rank(s) {different} differ from rank 0 "
            f"at {where}. Build and wrap the model identically on all ranks."
        )
