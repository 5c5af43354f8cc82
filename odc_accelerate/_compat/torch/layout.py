"""The reduce-scatter layout that the engine's hook must know, on every supported torch, and HSDP's deferred
all-reduce across replicas.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .. import patch_attribute
from . import _FSDP, _LIBRARY, _check_signature, _require, has
from .fsdp import group_fqn, trainable_params

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
