"""What the balanced step reports: metric gathers reduced once per step (per-step timing: `timing.StepTimer`).

* `DeferredGather` answers ``accelerator.gather`` / ``gather_for_metrics`` locally during microbatches (TRL makes
  several per microbatch; a collective there would make ranks with fewer microbatches hang) and records what went
  through; `reduce_step_metrics` turns the records of all ranks into global sums with one all-reduce.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["MAX_GATHERS_PER_MICROBATCH", "DeferredGather", "StepMetrics", "reduce_step_metrics"]

# Fixed, since a rank with no microbatch must join the same all-reduce as the others.
MAX_GATHERS_PER_MICROBATCH = 32


class DeferredGather:
    """Stands in for ``accelerator.gather`` / ``gather_for_metrics`` / ``reduce`` during microbatches: answers with the
    local value.

    A gather of a tensor returns ``[world * n, ...]`` rows; answering with this rank's rows only keeps shapes valid for
    sums, means, ratios, minima and maxima. For every tensor that goes through, the sum, the element count and the
    NaN-ignoring minimum and maximum are recorded per call position, so that one collective at the step boundary gives
    global sums, means, minima and maxima over the whole step. A ``reduce`` of a ``[sum, count]`` pair (how TRL
    averages a masked quantity over every rank) is recorded as that sum and count.

    The records of a zero-weight microbatch (`data.ZeroWeightMicrobatch`) are kept apart: they enter this rank's local
    sums (what the trainer counted as it went) but not the global values.
    """

    def __init__(self) -> None:
        self.calls: list[list[tuple[float, float, float, float]]] = []  # per microbatch: (sum, count, min, max)
        self.zero_weight_calls: list[list[tuple[float, float, float, float]]] = []
        self.current: list[tuple[float, float, float, float]] | None = None

    def start_microbatch(self, zero_weight: bool = False) -> None:
        self.current = []
        (self.zero_weight_calls if zero_weight else self.calls).append(self.current)

    def _record(self, tensor: torch.Tensor, pair: bool = False) -> None:
        if self.current is None:
            return
        values = tensor.detach().double().reshape(-1).cpu()
        if pair and values.numel() == 2:
            self.current.append((float(values[0]), float(values[1]), float("nan"), float("nan")))
            return
        finite = values[~torch.isnan(values)]
        low, high = (float(finite.min()), float(finite.max())) if finite.numel() else (float("nan"), float("nan"))
        self.current.append((float(values.sum()), float(values.numel()), low, high))

    def scale_call(self, position: int, factor: float) -> None:
        """Multiply the sum recorded by the current microbatch's ``position``-th call by ``factor`` (a weighted
        metric: the step's value is then the global sum)."""
        if self.current is not None and position < len(self.current):
            total, count, low, high = self.current[position]
            self.current[position] = (total * factor, count, low, high)

    def __call__(self, input_data: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(input_data, torch.Tensor):
            self._record(input_data)
            return input_data.reshape(1) if input_data.dim() == 0 else input_data
        if isinstance(input_data, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in input_data):
            return type(input_data)(self(t) for t in input_data)
        return input_data  # objects: this rank's own, like a one-process gather

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """``accelerator.reduce`` answered locally (a one-process reduce); see the class docstring."""
        if isinstance(tensor, torch.Tensor):
            self._record(tensor, pair=True)
            return tensor * scale if scale != 1.0 else tensor
        return tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMetrics:
    """One step's metric gathers over all ranks.

    ``local_sums[i]`` / ``global_sums[i]`` are the sums over this rank's / all ranks' microbatches of the tensor passed
    to the i-th gather of a microbatch (local: every microbatch the rank ran, zero-weight ones included, as the
    trainer counted them; global: those of weight 1), ``global_counts[i]`` its number of elements over all ranks (so that
    ``global_sums[i] / global_counts[i]`` is a mean over the whole step), ``global_mins[i]`` / ``global_maxs[i]`` its
    NaN-ignoring extremes over all ranks (NaN where no value was seen). ``local_microbatches``: the microbatches this
    rank ran (each recorded its values with the trainer); ``global_microbatches``: those of weight 1 over all ranks.
    """

    local_sums: list[float]
    global_sums: list[float]
    global_counts: list[float]
    global_mins: list[float]
    global_maxs: list[float]
    local_microbatches: int
    global_microbatches: int
    gathers_per_microbatch: int


class _Packet:
    """Named slices of the one float64 row each rank contributes at the step boundary (gathered, then combined).

    Layout: ``sums[slots] | counts[slots] | mins[slots] | maxs[slots] | microbatches | uneven | width | width_sq |
    has_work``. Ranks agree that every microbatch with work made the same number of gathers iff ``(sum width)^2 ==
    ranks_with_work x sum width^2`` (equality in Cauchy-Schwarz), decided alike on every rank from the gathered rows.
    """

    SCALARS = ("microbatches", "uneven", "width", "width_sq", "has_work")
    FIELDS = ("sums", "counts", "mins", "maxs")

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.size = len(self.FIELDS) * slots + len(self.SCALARS)

    def field(self, v: torch.Tensor, name: str) -> torch.Tensor:
        start = self.FIELDS.index(name) * self.slots
        return v[..., start : start + self.slots]

    def index(self, name: str) -> int:
        return len(self.FIELDS) * self.slots + self.SCALARS.index(name)


def _nan_extreme(rows: torch.Tensor, largest: bool) -> torch.Tensor:
    """Column-wise max (``largest``) or min of ``rows`` ignoring NaN; NaN where a column has no number."""
    fill = float("-inf") if largest else float("inf")
    filled = torch.where(torch.isnan(rows), torch.full_like(rows, fill), rows)
    out = filled.max(dim=0).values if largest else filled.min(dim=0).values
    return torch.where(torch.isinf(out) & (out == fill), torch.full_like(out, float("nan")), out)


def reduce_step_metrics(
    deferred: DeferredGather,
    gather: Callable[[torch.Tensor], torch.Tensor] | None,
    device: torch.device | str,
    slots: int = MAX_GATHERS_PER_MICROBATCH,
) -> StepMetrics | None:
    """Combine a step's deferred gathers over all ranks with one call of ``gather`` (`None`: a single process).

    ``gather`` takes a ``[1, n]`` row and returns every rank's rows (``accelerator.gather``); sums and counts are added
    up, minima and maxima taken, so one collective serves both.

    Returns `None` (and warns) when microbatches made different numbers of gathers: their meaning by position would
    differ, so the step's metrics stay local.

    Raises:
        RuntimeError: a microbatch of any rank made more than ``slots`` gathers, on every rank after the exchange (a
            rank that raised before it would leave the others waiting in the gather).
    """
    packet = _Packet(slots)
    ran = deferred.calls + deferred.zero_weight_calls
    width = max((len(c) for c in ran), default=0)
    uneven = any(len(c) != width for c in ran) or width > slots  # over: nothing recorded, only the width sent
    local = torch.zeros(packet.size, dtype=torch.float64)
    packet.field(local, "mins")[:] = float("nan")
    packet.field(local, "maxs")[:] = float("nan")
    if not uneven and deferred.calls:
        calls = torch.tensor(deferred.calls, dtype=torch.float64).reshape(len(deferred.calls), width, 4)
        packet.field(local, "sums")[:width] = calls[:, :, 0].sum(dim=0)
        packet.field(local, "counts")[:width] = calls[:, :, 1].sum(dim=0)
        packet.field(local, "mins")[:width] = _nan_extreme(calls[:, :, 2], largest=False)
        packet.field(local, "maxs")[:width] = _nan_extreme(calls[:, :, 3], largest=True)
    local[packet.index("microbatches")] = len(deferred.calls)
    local[packet.index("uneven")] = float(uneven)
    local[packet.index("width")] = float(width)
    local[packet.index("width_sq")] = float(width * width)
    local[packet.index("has_work")] = float(bool(ran))
    local_sums = packet.field(local, "sums").clone()
    if not uneven and width and deferred.zero_weight_calls:
        zero = torch.tensor(deferred.zero_weight_calls, dtype=torch.float64).reshape(-1, width, 4)
        local_sums[:width] += zero[:, :, 0].sum(dim=0)
    rows = local[None].to(device)
    if gather is not None:
        rows = gather(rows)
    rows = rows.reshape(-1, packet.size).cpu()
    widths = rows[:, packet.index("width")]
    if float(widths.max()) > slots:
        over = [rank for rank, w in enumerate(widths.tolist()) if w > slots]
        raise RuntimeError(
            f"ODC defers at most {slots} metric gathers per microbatch, but a microbatch made {int(widths.max())} (on "
            f"rank {', '.join(map(str, over))}): a trainer that gathers that many values per microbatch (its "
            "compute_loss's accelerator.gather / gather_for_metrics / reduce calls) cannot run under a plan. Gather "
            "fewer per microbatch, or run without --odc / --odc_plan."
        )
    total = rows.sum(dim=0)
    width_sum = float(total[packet.index("width")])
    width_sq = float(total[packet.index("width_sq")])
    ranks_with_work = float(total[packet.index("has_work")])
    if float(total[packet.index("uneven")]) > 0 or width_sum * width_sum != ranks_with_work * width_sq:
        logger.warning("ODC: microbatches made different numbers of metric gathers; their metrics are local.")
        return None
    return StepMetrics(
        local_sums=local_sums.tolist(),
        global_sums=packet.field(total, "sums").tolist(),
        global_counts=packet.field(total, "counts").tolist(),
        global_mins=_nan_extreme(packet.field(rows, "mins"), largest=False).tolist(),
        global_maxs=_nan_extreme(packet.field(rows, "maxs"), largest=True).tolist(),
        local_microbatches=len(ran),
        global_microbatches=int(total[packet.index("microbatches")]),
        gathers_per_microbatch=round(width_sum / ranks_with_work) if ranks_with_work else 0,
    )
