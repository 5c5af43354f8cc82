"""Telemetry a user can switch on: collective timing (`CollectiveTimer`) and per-step traces (`StepTrace`).

Both are driven by `~odc_accelerate.config.ODCConfig` options (``time_collectives``, ``trace_dir``) in the Trainer
integration, and usable directly in a custom loop. `CollectiveTimer` runs FSDP2's comms synchronously through its
custom-comm API and, while open (``dist_api=True``), wraps the blocking ``torch.distributed`` functions, counting the
time blocked. It measures, it does not train: it removes FSDP2's overlap (little on CPU). With ODC the engine owns the
comms (``fsdp_comms=False``). What is seen and what is not: docs/telemetry.md.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn

from ._compat.torch import fsdp as compat

__all__ = [
    "DIST_COMM_FUNCTIONS",
    "TIMED_DIST_FUNCTIONS",
    "CollectiveTimer",
    "StepTrace",
    "microbatch_shape",
    "patch_dist_functions",
    "restore_dist_functions",
    "timed_dist_functions",
]

# Blocking torch.distributed API functions a training step may wait in (those this torch has are wrapped).
TIMED_DIST_FUNCTIONS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "barrier",
    "monitored_barrier",
)


# The other torch.distributed communication functions: non-blocking, coalesced, point-to-point, group creation.
DIST_COMM_FUNCTIONS = TIMED_DIST_FUNCTIONS + (
    "all_reduce_coalesced",
    "all_gather_coalesced",
    "_all_gather_base",
    "_reduce_scatter_base",
    "scatter_object_list",
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

Patched = list[tuple[Any, str, Callable, Callable]]


def patch_dist_functions(names: tuple[str, ...], wrap: Callable[[str, Callable], Callable]) -> Patched:
    """Replace each of ``names`` this torch has by ``wrap(name, original)``, on ``torch.distributed`` and on
    ``distributed_c10d`` (callers bind either; a function both modules hold is wrapped once). Returns what
    `restore_dist_functions` needs to put the originals back."""
    patched: Patched = []
    wrapped: dict[int, Callable] = {}
    for name in names:
        for module in (dist, c10d):
            original = getattr(module, name, None)
            if original is None:
                continue
            if id(original) not in wrapped:
                wrapped[id(original)] = wrap(name, original)
            setattr(module, name, wrapped[id(original)])
            patched.append((module, name, original, wrapped[id(original)]))
    return patched


def restore_dist_functions(patched: Patched) -> None:
    """Undo `patch_dist_functions`, leaving alone a function someone patched again since."""
    for module, name, original, wrapper in reversed(patched):
        if getattr(module, name, None) is wrapper:
            setattr(module, name, original)


class _TimedComm:
    """Wraps one FSDP2 comm object (all-gather or reduce-scatter): same allocation, synchronous call, timed."""

    def __init__(self, inner: Any, timer: CollectiveTimer) -> None:
        self.inner, self.timer = inner, timer

    def allocate(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["async_op"] = False

        def call() -> None:
            work = self.inner(*args, **kwargs)
            if work is not None:  # a backend may still hand back a Work object
                work.wait()

        self.timer._timed(call)
        return None


class CollectiveTimer:
    """Counts the seconds this rank spends blocked in collectives: FSDP2's all-gathers and reduce-scatters and the
    blocking ``torch.distributed`` API calls.

    Args:
        model (`torch.nn.Module`, *optional*): the ROOT module returned by ``fully_shard``; needed with ``fsdp_comms``.
        fsdp_comms (`bool`, *optional*, defaults to `True`): run FSDP2's comms synchronously and time them.
        dist_api (`bool`, *optional*, defaults to `True`): time the functions in `TIMED_DIST_FUNCTIONS` (patched on
            ``torch.distributed`` and ``torch.distributed.distributed_c10d`` while the timer is open).

    Example:

    ```python
    timer = CollectiveTimer(model)
    ...  # one optimizer step
    waited = timer.take()  # seconds since the last take()
    timer.close()  # FSDP2's own comms and torch.distributed's functions again
    ```
    """

    def __init__(self, model: nn.Module | None = None, *, fsdp_comms: bool = True, dist_api: bool = True) -> None:
        if fsdp_comms and (model is None or not compat.is_fsdp2(model)):
            raise TypeError(f"CollectiveTimer needs an FSDP2 model (fully_shard), got {type(model).__name__}")
        self.seconds = 0.0
        self.calls = 0
        self._local = threading.local()  # nesting depth: a dist call inside a timed FSDP2 comm counts once
        self._saved: list[tuple[Any, tuple[Any, Any]]] = []
        self._patched: Patched = []
        if fsdp_comms:
            for _module, state in compat.all_states(model):
                for group in compat.param_groups(state):
                    all_gather, reduce_scatter = compat.get_comms(group)
                    self._saved.append((group, (all_gather, reduce_scatter)))
                    compat.set_comms(group, _TimedComm(all_gather, self), _TimedComm(reduce_scatter, self))
        if dist_api:
            self._patched = patch_dist_functions(TIMED_DIST_FUNCTIONS, lambda _name, original: self._wrap(original))

    def _timed(self, fn: Callable[[], Any]) -> Any:
        depth = getattr(self._local, "depth", 0)
        if depth:
            return fn()
        self._local.depth = 1
        start = time.perf_counter()
        try:
            return fn()
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1
            self._local.depth = 0

    def _wrap(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            return self._timed(lambda: original(*args, **kwargs))

        timed._odc_timed = True  # type: ignore[attr-defined]  # tells a timed function from torch's own
        return timed

    def take(self) -> float:
        """Seconds spent in collectives since the previous call (or since construction)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def close(self) -> None:
        """Put FSDP2's original comm objects and torch.distributed's functions back. Idempotent."""
        for group, comms in self._saved:
            compat.set_comms(group, *comms)
        self._saved = []
        restore_dist_functions(self._patched)  # leaves a later patch (e.g. a call counter) alone
        self._patched = []


def timed_dist_functions() -> list[str]:
    """Names of the ``torch.distributed`` functions a `CollectiveTimer` currently wraps in this process."""
    return [n for n in TIMED_DIST_FUNCTIONS if getattr(getattr(dist, n, None), "_odc_timed", False)]


def microbatch_shape(batch: Any) -> dict[str, Any]:
    """What a microbatch costs to compute: ``rows`` x ``width`` (the padded shape the model runs on) and the real
    (non-padding) tokens of each row.

    Padding-free batches (one row of packed sequences with ``position_ids``) give the packed sequences' lengths as
    ``segments`` (attention cost is per sequence, not per row). Batches with images (``image_grid_thw``, as
    Qwen-VL processors give) add ``images``, their ``patches`` (the rows of ``pixel_values`` they need) and
    ``pixel_rows`` (the rows of ``pixel_values`` the batch holds).
    """
    # A processor's output (TRL's vision collator) is a `transformers.BatchFeature`: a mapping, not a dict.
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if ids is None or ids.dim() != 2:
        return {"rows": 0, "width": 0, "row_tokens": []}
    rows, width = int(ids.shape[0]), int(ids.shape[1])
    mask = batch.get("attention_mask")
    row_tokens = mask.sum(dim=1).tolist() if mask is not None and mask.dim() == 2 else [width] * rows
    out: dict[str, Any] = {"rows": rows, "width": width, "row_tokens": [int(t) for t in row_tokens]}
    positions = batch.get("position_ids")
    if mask is None and positions is not None and positions.dim() == 2 and rows == 1:
        starts = (positions[0] == 0).nonzero().flatten().tolist() + [width]
        out["segments"] = [int(b - a) for a, b in zip(starts[:-1], starts[1:], strict=True) if b > a]
    grid = batch.get("image_grid_thw")
    if grid is not None and grid.dim() == 2:
        pixels = batch.get("pixel_values")
        out["images"] = int(grid.shape[0])
        out["patches"] = int(grid.prod(dim=-1).sum())
        out["pixel_rows"] = int(pixels.shape[0]) if pixels is not None else 0
    return out


class StepTrace:
    """Per-rank record of every optimizer step: its microbatches' shapes and the step's time, busy and wait.

    One JSON line per step in ``<directory>/trace_rank<RANK>.jsonl``: ``{"step", "step_s", "busy_s", "wait_s",
    "microbatches": [microbatch_shape(...), ...]}``. The Trainer integration writes it when the ``trace_dir`` option
    (``--odc_trace_dir``, ``ODC_TRACE_DIR``) is set; the end-to-end benchmark sets it for the simulator's replay.

    Args:
        directory (`str`): created if missing.
        rank (`int`): this process's rank (the file name).
    """

    def __init__(self, directory: str, rank: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"trace_rank{rank}.jsonl")
        self.steps = 0
        open(self.path, "w").close()  # a rerun into the same folder starts a new trace

    def record(self, microbatches: list[dict[str, Any]], step_s: float, busy_s: float, wait_s: float) -> None:
        self.steps += 1
        row = {"step": self.steps, "step_s": step_s, "busy_s": busy_s, "wait_s": wait_s, "microbatches": microbatches}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
