"""The transport side of the ordered gradient reduction (``odc_reduction: ordered``), on any transport.

No rank adds into another's memory: each rank adds its microbatches' contributions for owner ``o`` into its own buffer
``"<group>/to<o>"`` (`add_contribution`); after a barrier each owner reads every rank's buffer in rank order and sums
them (`sum_in_rank_order`: the same bits whatever order the ranks finished in); after a second barrier each rank zeroes
its buffers (`zero_contributions`). Why pull, and the memory it takes: docs/reduction.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .base import BufferSpec, Transport

__all__ = [
    "add_contribution",
    "contribution_name",
    "contribution_names",
    "contribution_specs",
    "sum_in_rank_order",
    "zero_contributions",
]


def contribution_name(group: str, owner: int) -> str:
    """The buffer that holds a rank's contribution to ``owner``'s shard of ``group``: ``"<group>/to<owner>"``."""
    return f"{group}/to{owner}"


def contribution_names(group: str, world_size: int) -> list[str]:
    """``group``'s buffer names, one per destination owner, indexed by owner."""
    return [contribution_name(group, owner) for owner in range(world_size)]


def contribution_specs(group: str, shard_numel: int, dtype: torch.dtype, world_size: int) -> dict[str, BufferSpec]:
    """The buffers a rank registers for ``group`` under the ordered reduction: per owner, one shard of ``dtype``.

    Args:
        group (`str`): the param group's key, unique among the registered buffers (e.g. ``"c0"``).
        shard_numel (`int`): elements of one shard (one row of the reduce-scatter input).
        dtype (`torch.dtype`): the reduce dtype.
        world_size (`int`): ranks, i.e. owners.

    Returns:
        `dict[str, BufferSpec]`: ``"<group>/to<o>"`` for ``o = 0 .. world_size - 1``, none ``accumulated`` (only the
        rank itself writes them; peers read them).
    """
    spec = BufferSpec(numel=shard_numel, dtype=dtype)
    return dict.fromkeys(contribution_names(group, world_size), spec)


def add_contribution(buffers: Mapping[str, torch.Tensor], group: str, rows: torch.Tensor) -> None:
    """Add one microbatch's reduce-scatter input into this rank's own contributions: ``to<o> += rows[o]``.

    Args:
        buffers (`Mapping[str, torch.Tensor]`): this rank's registered buffers (what ``register`` returned).
        group (`str`): the param group's key.
        rows (`torch.Tensor`): ``[world_size, shard_numel]`` (or its flat view), row ``o`` owned by rank ``o``.
    """
    rows = rows.reshape(-1, buffers[contribution_name(group, 0)].numel())
    for owner in range(rows.shape[0]):
        buffers[contribution_name(group, owner)].add_(rows[owner])


def zero_contributions(buffers: Mapping[str, torch.Tensor], group: str, world_size: int) -> None:
    """Zero this rank's contributions to ``group`` after every owner has read them (the barrier after the sums)."""
    for name in contribution_names(group, world_size):
        buffers[name].zero_()


def sum_in_rank_order(
    transport: Transport, names: Sequence[str], out: torch.Tensor, *, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's shard of one group: every rank's contribution to it, summed in rank order into ``out``.

    Reads ``names[transport.rank]`` from ranks ``0, 1, ..., W-1`` in turn and computes ``out = c_0; out += c_1; ...``:
    fixed operands in a fixed order, so the same contributions give the same bits on every run and transport. Call it
    between two barriers: after every rank's contributions are complete, before any rank zeroes them.

    Args:
        transport (`Transport`): the registered transport; its ``rank`` is the owner, its ``world_size`` the ranks.
        names (`Sequence[str]`): the group's buffer names, indexed by owner (`contribution_names`).
        out (`torch.Tensor`): receives the sum, 1-D with the shard's elements; its dtype may be wider than the
            contributions' (an fp32 sum of bf16 contributions).
        scratch (`torch.Tensor`, *optional*): a temporary of the contributions' dtype with at least the shard's
            elements, reused for every read (one shard for all groups); allocated when not given.

    Returns:
        `torch.Tensor`: ``out``.
    """
    if len(names) != transport.world_size:
        raise ValueError(f"{len(names)} buffer names for {transport.world_size} ranks: one per owner is needed")
    if out.dim() != 1:
        raise ValueError(f"out must be 1-D, got shape {tuple(out.shape)}")
    name, numel = names[transport.rank], out.numel()
    if scratch is None:
        scratch = torch.empty(numel, dtype=out.dtype, device=out.device)
    elif scratch.numel() < numel:
        raise ValueError(f"scratch holds {scratch.numel()} elements, the shard {numel}")
    tmp = scratch[:numel]
    for rank in range(transport.world_size):
        transport.read(rank, name, tmp)
        if rank == 0:
            out.copy_(tmp)
        else:
            out.add_(tmp)
    return out
