"""Per-step timing of the ODC Trainer: `StepTimer` times each optimizer step per rank (step, busy: the rank's own
forward and backward, wait: the rest of the step), optionally times plain FSDP2's collectives and writes step traces,
and turns a logging interval's steps into the ``odc/*`` metrics."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["StepTimer"]


class StepTimer:
    """Per-rank timing of optimizer steps, reported per logging interval as ``odc/*`` metrics.

    One definition for every system (ODC, plain FSDP2, no communication) and every device:

    * **step** runs from `start` (the step's microbatches are being fetched) to `end` (after the optimizer); a logging
      interval lasts as long as its slowest rank's steps;
    * **busy** is the rank's own compute: the forward and backward of its microbatches, each timed by `compute`, less
      any time blocked on peers inside them that the process can see (a plain FSDP2 collective timed by a
      `~odc_accelerate.telemetry.CollectiveTimer`, an ODC barrier). On CPU a microbatch is timed with the host clock;
      on a CUDA device with CUDA events around its kernels, so queued work is not booked to the host's wait;
    * **wait** is everything else in the interval: ODC's barriers, the step's metric reductions and token count, plain
      FSDP2's collectives, the optimizer step and its wait for peers, fetching the next step's data.

    Without ``time_collectives``, plain FSDP2's waits inside its per-layer collectives happen within the microbatches
    and count as busy; ODC makes no blocking call there. On a CUDA device, plain FSDP2's NCCL waits are stream waits
    inside the timed kernels and also count as busy.

    Args:
        rank (`int`): this process's rank (names the trace file).
        trace_dir (`str`, *optional*): write a `~odc_accelerate.telemetry.StepTrace` there.
        time_collectives (`bool`, *optional*, defaults to `False`): time plain FSDP2's collectives.
    """

    def __init__(self, rank: int, trace_dir: str | None = None, time_collectives: bool = False) -> None:
        self.rank = rank
        self.trace_dir = trace_dir
        self.time_collectives = time_collectives
        self.pending: list[dict[str, Any]] = []
        self.step: dict[str, Any] = {}
        self.timer: Any = None  # telemetry.CollectiveTimer on timed plain-FSDP2 runs
        self.trace: Any = None  # telemetry.StepTrace, created at the first step
        self._engine: Any = None
        self._depth = 0  # open `compute` blocks

    def start(self, model: Any, engine: Any, microbatches: list[Any], start: float) -> None:
        """Begin a step at ``start`` (``time.perf_counter()``) with this rank's ``microbatches``."""
        from ...telemetry import microbatch_shape
        from .data import input_tokens

        self._engine = engine
        self.step = {
            "start": start,
            "microbatches": len(microbatches),
            "tokens": sum(input_tokens(mb) for mb in microbatches),
            "busy_s": 0.0,  # host-timed compute
            "generation_s": 0.0,  # wall time inside generate (RL trainers)
            "events": [],  # (start, end) CUDA event pairs of device-timed compute
        }
        if self.time_collectives and self.timer is None and engine is None:
            from ..._compat.torch import fsdp as fsdp_compat
            from ...telemetry import CollectiveTimer

            if fsdp_compat.is_fsdp2(model):
                self.timer = CollectiveTimer(model)
        if self.trace_dir is not None:
            if self.trace is None:
                from ...telemetry import StepTrace

                self.trace = StepTrace(self.trace_dir, self.rank)
            self.step["shapes"] = [microbatch_shape(mb) for mb in microbatches]

    def add_work(self, microbatches: int, tokens: int) -> None:
        """Count work known only once the step runs (an RL step's microbatches exist after its generation)."""
        if "start" in self.step:
            self.step["microbatches"] += int(microbatches)
            self.step["tokens"] += int(tokens)

    def add_microbatch(self, batch: Any) -> None:
        """Count one collated microbatch known only once the step runs (a microbatch claimed under the ``dynamic``
        plan): its tokens, and its shape in the trace."""
        from ...telemetry import microbatch_shape
        from .data import input_tokens

        if "start" in self.step:
            self.add_work(1, input_tokens(batch))
            if "shapes" in self.step:
                self.step["shapes"].append(microbatch_shape(batch))

    def add_generation(self, seconds: float) -> None:
        """Count ``seconds`` of this step spent inside ``generate`` (reported as ``odc/generation_s_rank<r>``)."""
        if "start" in self.step:
            self.step["generation_s"] += float(seconds)

    def _blocked_s(self) -> float:
        """Seconds this process has been seen blocked on peers so far (monotonic within a microbatch)."""
        seconds = self.timer.seconds if self.timer is not None else 0.0
        stats = getattr(self._engine, "stats", None)
        return seconds + (float(stats.wait_s) if stats is not None else 0.0)

    @contextlib.contextmanager
    def compute(self, device: torch.device | str) -> Iterator[None]:
        """Time one piece of own compute (a microbatch's forward and backward) on ``device`` as busy.

        A no-op when no step is open, and inside another `compute` block (what is nested is already timed).
        """
        if "start" not in self.step or self._depth:
            yield
            return
        cuda = torch.device(device).type == "cuda"
        if cuda:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
        blocked, start = self._blocked_s(), time.perf_counter()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.step["events"].append((begin, end))
            else:
                self.step["busy_s"] += (time.perf_counter() - start) - (self._blocked_s() - blocked)

    @contextlib.contextmanager
    def generation(self, device: torch.device | str) -> Iterator[None]:
        """Time one ``generate`` call: busy as `compute`, and its wall time as ``odc/generation_s_rank<r>``."""
        start = time.perf_counter()
        try:
            with self.compute(device):
                yield
        finally:
            self.add_generation(time.perf_counter() - start)

    def end(self, engine: Any, end: float) -> None:
        """Close the step begun by `start` at ``end``; a no-op when no step is open."""
        if "start" not in self.step:
            return
        if self.timer is not None:
            self.timer.take()  # what it counted is inside the step: only in-microbatch waits were subtracted
        entry = {
            "step_s": end - self.step["start"],
            "busy_s": self.step["busy_s"],
            "events": self.step["events"],
            "microbatches": float(self.step["microbatches"]),
            "tokens": float(self.step["tokens"]),
            "generation_s": float(self.step["generation_s"]),
            "peak_mb": _peak_memory_mb(engine),
        }
        self.pending.append(entry)
        if self.trace is not None:
            busy = _resolve(entry)
            self.trace.record(self.step.get("shapes", []), entry["step_s"], busy, entry["step_s"] - busy)
        self.step = {}
        self._engine = None

    def interval_metrics(
        self,
        gather: Callable[[torch.Tensor], torch.Tensor] | None,
        device: torch.device | str,
        per_rank: bool = False,
    ) -> dict[str, float]:
        """The ``odc/*`` metrics of the steps ended since the last call (one ``gather`` of a row per rank): the minimum,
        maximum and mean over ranks of busy, wait (and generation) time, and with ``per_rank`` each rank's too."""
        pending, self.pending = self.pending, []
        step_s = sum(p["step_s"] for p in pending)
        busy_s = sum(_resolve(p) for p in pending)
        mbs = [p["microbatches"] for p in pending]
        tokens = sum(p["tokens"] for p in pending)
        generation_s = sum(p.get("generation_s", 0.0) for p in pending)
        peak_mb = max(p.get("peak_mb", 0.0) for p in pending)
        row = torch.tensor(
            [step_s, busy_s, min(mbs), max(mbs), tokens, generation_s, peak_mb], dtype=torch.float64, device=device
        )
        rows = row[None]
        if gather is not None:
            rows = gather(row[None])  # step boundary: one gather per logged interval
        rows = rows.reshape(-1, row.numel()).cpu()
        # The interval's time is the slowest rank's: every rank's busy + wait adds up to it.
        step_s = float(rows[:, 0].max())
        tokens = float(rows[:, 4].sum())  # input tokens of every rank
        out: dict[str, float] = {
            "odc/tokens_per_s": round(tokens / step_s, 1) if step_s > 0 else 0.0,
            "odc/step_s": round(step_s / len(pending), 4),
            "odc/microbatches_min": int(rows[:, 2].min()),
            "odc/microbatches_max": int(rows[:, 3].max()),
            "odc/bubble_pct": round(100.0 * (1.0 - float(rows[:, 1].mean()) / step_s), 2) if step_s > 0 else 0.0,
        }
        busy = rows[:, 1]
        wait = (step_s - busy).clamp(min=0.0)  # on a device the host may close a step before its last kernels end
        series = {"busy_s": busy, "wait_s": wait}
        if float(rows[:, 5].max()) > 0:  # trainers that generate: time inside generate, part of busy
            series["generation_s"] = rows[:, 5]
        if float(rows[:, 6].max()) > 0:  # each rank's peak memory so far (GPU: allocated; CPU: resident set)
            series["peak_mem_mb"] = rows[:, 6]
        for name, values in series.items():
            out[f"odc/{name}_min"] = round(float(values.min()), 4)
            out[f"odc/{name}_max"] = round(float(values.max()), 4)
            out[f"odc/{name}_mean"] = round(float(values.mean()), 4)
            if per_rank:
                for r in range(rows.shape[0]):
                    out[f"odc/{name}_rank{r}"] = round(float(values[r]), 4)
        return out

    def close(self) -> None:
        """Put back what the collective timer patched. Idempotent."""
        timer, self.timer = self.timer, None
        if timer is not None:
            timer.close()


def _peak_memory_mb(engine: Any) -> float:
    """This rank's peak memory so far in MiB: the engine's figure for the step it just published, else (plain runs)
    read the same way (`odc_accelerate.memory_spec.PeakMemory`)."""
    stats = getattr(engine, "last_step_stats", None)
    if stats is not None and getattr(stats, "peak_memory_bytes", 0):
        return stats.peak_memory_bytes / 2**20
    from ...memory_spec import PeakMemory

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return PeakMemory(device).read() / 2**20


def _resolve(entry: dict[str, Any]) -> float:
    """A pending step's busy seconds: host-timed compute plus its CUDA event pairs (waits for the last one)."""
    events = entry.pop("events", [])
    if events:
        events[-1][1].synchronize()
        entry["busy_s"] += sum(begin.elapsed_time(end) for begin, end in events) / 1000.0
    return entry["busy_s"]
