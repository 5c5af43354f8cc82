"""Count every torch.distributed communication call made inside a ``with`` block.

Two independent nets, so that a call cannot slip through either way:

* the Python API: every function of `odc_accelerate.telemetry.DIST_COMM_FUNCTIONS` is wrapped (on both
  ``torch.distributed`` and ``distributed_c10d``, since callers bind either);
* the dispatcher: a ``TorchDispatchMode`` sees every ``c10d`` / functional-collective op, which is how DTensor,
  functional collectives and the Python API all reach a backend.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterator

from odc_accelerate._compat.torch import dispatch as dispatch_compat
from odc_accelerate.telemetry import DIST_COMM_FUNCTIONS, patch_dist_functions, restore_dist_functions

COMM_OP_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


class _OpCounter(dispatch_compat.torch_dispatch_mode()):
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

    def wrap(name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def counted(*args, **kwargs):
            counts[f"api:{name}"] += 1
            return original(*args, **kwargs)

        return counted

    patched = patch_dist_functions(DIST_COMM_FUNCTIONS, wrap)
    try:
        with _OpCounter(counts):
            yield counts
    finally:
        restore_dist_functions(patched)
