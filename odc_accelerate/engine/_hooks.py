"""FSDP2's collective hooks under ODC: they hand FSDP2's all-gather and reduce-scatter to the engine's data path.

Each hook is given the callable that does the work for its param group (the engine's gather or scatter-accumulate,
bound to the group's index), not the engine itself: the hooks only adapt FSDP2's call signature and allocation.
`accumulator_rows` adapts FSDP2's reduce-scatter input to the accumulators' layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .._compat.torch import fsdp as compat
from .._compat.torch import layout as layout_compat

if TYPE_CHECKING:  # pragma: no cover
    from ._common import ServedGroup

#: Fill the peers' rows of an all-gather output from their published shards.
Gather = Callable[[torch.Tensor], None]
#: Add each owner's slice of a reduce-scatter input (first) into its accumulator and zero the output (second); the
#: third argument is the reduce op FSDP2 passed.
ScatterAccumulate = Callable[[torch.Tensor, torch.Tensor, Any], None]


class _ODCAllGather(compat.AllGather):
    """FSDP2 all-gather hook: fill the peers' rows of the output from their published shards."""

    def __init__(self, gather: Gather) -> None:
        self._gather = gather

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False):
        self._gather(output_tensor)
        return None


class _ODCReduceScatter(compat.ReduceScatter):
    """FSDP2 reduce-scatter hook: add each owner's slice into its accumulator, return zeros."""

    def __init__(self, scatter_accumulate: ScatterAccumulate) -> None:
        self._scatter_accumulate = scatter_accumulate

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # FSDP2 may turn the output into `.grad` (a view): it must be fresh memory every call.
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ):
        self._scatter_accumulate(input_tensor, output_tensor, op)
        return None


class _ODCReduceScatterHSDP(_ODCReduceScatter):
    """The reduce-scatter hook on an HSDP mesh: FSDP2's per-microbatch all-reduce across replicas is switched off
    (the engine all-reduces once per step)."""

    odc_defers_all_reduce = True


def accumulator_rows(g: ServedGroup, inp: torch.Tensor, world_size: int) -> torch.Tensor:
    """FSDP2's reduce-scatter input ``inp`` for group ``g`` as one row per owner, in the layout of the owners'
    accumulators ``g<i>``.

    Raises:
        RuntimeError: ``inp``'s size or dtype is not the group's (its trainable parameters changed after set-up).
    """
    rows = inp.view(world_size, -1)
    # None: the rows have the accumulator's layout. Else (torch 2.11, some params got no gradient) where each
    # param's segment of the rows goes.
    spans = layout_compat.reduce_scatter_spans(g.group, compat.get_comms(g.group)[1])
    expected = g.reduce_numel if spans is None else sum(numel for _, _, numel in spans)
    if rows.shape[1] != expected or inp.dtype != g.reduce_dtype:
        raise RuntimeError(
            f"ODC reduce-scatter for {g.fqn}: got {rows.shape[1]} x {inp.dtype} per rank, expected "
            f"{expected} x {g.reduce_dtype}; trainable parameters changed after ODCEngine()"
        )
    if spans is None:
        return rows
    full = rows.new_zeros(world_size, g.reduce_numel)  # params without a gradient add zeros
    for src, dst, numel in spans:
        full[:, dst : dst + numel] = rows[:, src : src + numel]
    return full
