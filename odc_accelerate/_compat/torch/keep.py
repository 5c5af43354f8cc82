"""What a rank keeps unsharded through a step: the FSDP2 switches the step memory policy sets per param group, and the
reduction of the gradients it kept, at the step boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import CompatError
from . import _require, has

# The step memory policy (`odc_accelerate.engine.memory`) sets FSDP2's own per-group switches: `post_forward_mesh_info`
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
