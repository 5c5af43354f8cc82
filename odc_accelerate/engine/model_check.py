"""Checks that every rank of an `ODCEngine` agrees on: the FSDP2 model before the engine serves it, and the
optimizer's param groups at each step.

Every model check here runs before the engine's first collective, and a refusal found on some ranks only is raised on
every rank (`agree_on_model`): a rank that raised alone would leave its peers waiting in the next collective. The
optimizer check compares fingerprints that the ranks exchange with the step's flags (`optimizer_refusal`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from .._compat.torch import fsdp as compat

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


def agree_on_model(entries: list[Entry], problem: str | Exception | None, group: Any = None) -> None:
    """Raise on every rank of ``group`` if any rank refused the model, could not set it up, or built different groups.

    Collective over ``group``. All ranks must build the same groups in the same order, or reads would mix layers.

    Args:
        entries: this rank's `served_groups`.
        problem: this rank's reason to stop, or None. A string refuses the model: a `ValueError` here, and on the
            peers one naming this rank. An exception is a set-up failure that names its rank in its text (e.g. running
            out of GPU memory in FSDP2's lazy initialisation): raised as it is here, and with the same type and text on
            the peers, which would otherwise wait for this rank in their next collective until the process group's
            timeout. Its type must be importable on every rank (a built-in one is).
    """
    failure = (type(problem), str(problem)) if isinstance(problem, Exception) else None
    # A rank that stops has nothing to compare (its FSDP2 state may be half initialised): only a refusal is sent.
    signature = (
        None
        if problem is not None
        else [(compat.group_fqn(g), compat.group_layout(g), str(compat.reduce_dtype(g))) for _, g in entries]
    )
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (signature, problem if failure is None else None, failure), group=group)
    if isinstance(problem, Exception):
        raise problem
    rank = dist.get_rank(group)
    stops = [(r, text, failed) for r, (_, text, failed) in enumerate(gathered) if text is not None or failed]
    if stops:
        first, text, failed = stops[0]
        if failed is not None:
            kind, message = failed
            raise kind(message)
        raise ValueError(text if first == rank else f"rank {first} refused the model: {text}")
    signatures = [s for s, _, _ in gathered]
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


#: bytes of an optimizer fingerprint (`optimizer_fingerprint`); all zero stands for "no optimizer given"
FINGERPRINT_BYTES = 8


def optimizer_layout(model: nn.Module, optimizer: Any) -> list[list[str]]:
    """The FQNs of each of ``optimizer``'s param groups, in order (a parameter that is not ``model``'s by its shape)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [
        [names.get(id(p), f"<not in the model: {tuple(p.shape)}>") for p in group["params"]]
        for group in optimizer.param_groups
    ]


def optimizer_fingerprint(layout: list[list[str]]) -> bytes:
    """`FINGERPRINT_BYTES` bytes standing for an `optimizer_layout` (never all zero)."""
    digest = hashlib.blake2b(repr(layout).encode(), digest_size=FINGERPRINT_BYTES).digest()
    return digest if any(digest) else b"\x01" * FINGERPRINT_BYTES


class OptimizerFingerprints:
    """The fingerprint and layout of the optimizer a rank steps, read again only when its param groups change.

    Args:
        model (`torch.nn.Module`): the model whose parameter names the layout gives.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._seen: tuple[Any, bytes, list[list[str]]] | None = None  # (groups' ids, fingerprint, layout)

    def read(self, optimizer: Any) -> tuple[bytes, list[list[str]] | None]:
        """``optimizer``'s `optimizer_fingerprint` and `optimizer_layout`; all zero and None without an optimizer."""
        if optimizer is None:
            return bytes(FINGERPRINT_BYTES), None
        key = (id(optimizer), tuple(tuple(id(p) for p in group["params"]) for group in optimizer.param_groups))
        if self._seen is None or self._seen[0] != key:
            layout = optimizer_layout(self._model, optimizer)
            self._seen = (key, optimizer_fingerprint(layout), layout)
        return self._seen[1], self._seen[2]


def optimizer_refusal(fingerprints: Sequence[bytes], layout: list[list[str]] | None) -> str | None:
    """Why the ranks' optimizers would step the shards of one parameter under different param groups, or None.

    Args:
        fingerprints: every rank's `optimizer_fingerprint`, by rank; all zero for a rank that gave no optimizer (not
            compared). The same on every rank, so every rank refuses together.
        layout: this rank's `optimizer_layout`, which the text describes (None: this rank gave no optimizer).
    """
    given = {r: f for r, f in enumerate(fingerprints) if any(f)}
    if len(set(given.values())) <= 1:
        return None
    first = next(iter(given.values()))  # the lowest rank's
    same = [r for r, f in given.items() if f == first]
    different = [r for r, f in given.items() if f != first]
    here = (
        "no optimizer given"
        if layout is None
        else f"{len(layout)} group(s) of {', '.join(str(len(group)) for group in layout)} parameter(s)"
    )
    return (
        "ODC needs the optimizer's param groups to be the same on every rank (the same parameters, grouped and "
        "ordered alike): each rank steps its own shard of every parameter, so the shards of one parameter must follow "
        f"one group's settings. Rank(s) {different} group or order them differently from rank(s) {same} (this rank: "
        f"{here}). Build the optimizer the same way on every rank: the same "
        "groups, each listing its parameters in one order (e.g. model.named_parameters() order, not a set's)."
    )
