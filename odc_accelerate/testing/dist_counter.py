"""Count every torch.distributed communication call made inside a ``with`` block.

Two independent nets, so that a call cannot slip through either way:

* the Python API: every communication function of ``torch.distributed`` (both the package and
  ``distributed_c10d``, since callers bind either) is wrapped;
* the dispatcher: a ``TorchDispatchMode`` sees every ``c10d`` / functional-collective op, which is
  how DTensor, functional collectives and the Python API all reach a backend.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Iterator

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

COMM_FUNCTIONS = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_coalesced",
    "_all_gather_base",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "send_object_list",
    "recv_object_list",
    "new_group",
    "new_subgroups",
    "split_group",
)
COMM_OP_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


class _OpCounter(TorchDispatchMode):
    def __init__(self, counts: collections.Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace = getattr(func, "namespace", "")
        if namespace in COMM_OP_NAMESPACES:
            self.counts[f"op:{namespace}.{func.__name__}"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_dist_calls() -> Iterator[collections.Counter]:
    """Yield a Counter filled with ``name -> calls`` for every communication call inside the block."""
    counts: collections.Counter = collections.Counter()
    saved: list[tuple[object, str, object]] = []

    def wrap(name: str, original):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            counts[f"api:{name}"] += 1
            return original(*args, **kwargs)

        return counted

    for module in (dist, c10d):
        for name in COMM_FUNCTIONS:
            original = getattr(module, name, None)
            if original is not None:
                saved.append((module, name, original))
                setattr(module, name, wrap(name, original))
    try:
        with _OpCounter(counts):
            yield counts
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
