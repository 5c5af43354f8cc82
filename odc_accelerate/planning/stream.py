"""`StreamingStepPlanner`: the step plans of a stream of samples (a `datasets.IterableDataset`, a generator, ...).

Planning needs only the samples of one optimizer step, so a stream fits it: step ``k`` is the ``k``-th run of
``samples_per_step`` consecutive samples of the stream, planned exactly as `LengthBalancedBatchSampler` plans a step
(same cost, same padded shapes, same plan). Every rank reads the whole stream in the same order and keeps its own
microbatches: identical inputs give identical plans, with no communication.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..validation import check_positive_int
from .cost import CostSpec, QuadraticCost, check_costs, resolve_cost
from .dynamic import claim_queue
from .padded import plan_padded
from .plan import Plan, PlanName, check_oversize, normalize_plan, plan_from_costs, sample_parts

logger = logging.getLogger(__name__)

__all__ = ["StepRows", "StreamStep", "StreamingStepPlanner"]

LengthsFn = Callable[[list[Any]], "Sequence[int] | np.ndarray"]


class StepRows:
    """A list of row dicts seen as a small map-style dataset: ``rows[i]`` is a row, ``rows["col"]`` a column.

    Lets the length functions written for `datasets.Dataset` (`odc_accelerate.planning.dataset_lengths`, a trainer's
    ``_odc_lengths``) and the Trainer's unused-column removal read one step of a stream.

    Args:
        rows (`list[dict]`): the rows, in stream order.
    """

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key: int | str) -> Any:
        if isinstance(key, str):
            missing = sum(1 for row in self.rows if key not in row)
            if missing:
                raise KeyError(f"Column {key!r} is missing from {missing} of the step's {len(self.rows)} rows.")
            return [row[key] for row in self.rows]
        return self.rows[key]

    @property
    def column_names(self) -> list[str]:
        """The columns of the rows, in first-seen order."""
        names: dict[str, None] = {}
        for row in self.rows:
            if not isinstance(row, dict):
                raise TypeError(
                    f"A streamed sample is a {type(row).__name__}, not a dict of columns: planning reads each "
                    "sample's length from its columns (e.g. 'input_ids'). Map the stream to dict rows."
                )
            names.update(dict.fromkeys(row))
        return list(names)

    def remove_columns(self, names: str | Sequence[str]) -> StepRows:
        """The same rows without ``names`` (what `datasets.Dataset.remove_columns` does)."""
        drop = {names} if isinstance(names, str) else set(names)
        return StepRows([{k: v for k, v in row.items() if k not in drop} for row in self.rows])


@dataclass(frozen=True)
class StreamStep:
    """One optimizer step read from a stream.

    Attributes:
        index (`int`): the step's number counted from the start of the stream, over all passes.
        pass_index (`int`): the pass over the stream it was read in (the epoch given to the stream's ``set_epoch``).
        samples (`list`): the step's ``samples_per_step`` samples, in stream order.
        plan (`list[list[list[int]]]`): every rank's microbatches, as positions in ``samples``.
    """

    index: int
    pass_index: int
    samples: list[Any]
    plan: Plan

    def microbatches(self, rank: int) -> list[list[Any]]:
        """Rank ``rank``'s microbatches of this step, as lists of samples."""
        return [[self.samples[j] for j in mb] for mb in self.plan[rank]]

    def queue(self) -> list[list[Any]]:
        """The step's queue of microbatches in claim order (the ``"dynamic"`` plan, `claim_queue`), as lists of
        samples: the same on every rank."""
        return [[self.samples[j] for j in mb] for mb in claim_queue(self.plan)]


class StreamingStepPlanner:
    """Plans the optimizer steps of a stream: step ``k`` is the ``k``-th chunk of ``samples_per_step`` samples.

    Each chunk is planned as `LengthBalancedBatchSampler` plans a step made of the same samples in the same order
    (same cost model, same padded shapes, same ``"free"`` / ``"lockstep"`` plan), so a stream and a map-style dataset
    read in that order train the same microbatches. Nothing is shuffled here: the order is the stream's own (shuffle
    the stream with a seed, e.g. `datasets.IterableDataset.shuffle(seed=...)`; `steps` calls its ``set_epoch``).

    Passes and the end of the stream: a final chunk of fewer than ``samples_per_step`` samples is dropped (as the
    sampler's ``drop_last=True``). When a pass ends `steps` starts the next one (``set_epoch(pass)`` then a new
    iteration), so a run with a fixed number of steps continues over as many passes as it needs, as the Trainer does
    with a stream and ``max_steps``. A pass without one complete step raises a `ValueError`.

    Resuming: ``steps(stream, start_step=n)`` reads and drops the first ``n`` steps (their samples are read but no
    length is computed and nothing is planned), then continues with exactly the step an uninterrupted run would plan
    next. ``samples_per_step`` must be the one of the run being resumed.

    Args:
        world_size (`int`):
            Number of data-parallel ranks.
        samples_per_step (`int`):
            Samples per optimizer step over ALL ranks (at least ``world_size``).
        max_tokens_per_microbatch (`int`, *optional*, defaults to 8192):
            Token budget of one microbatch.
        cost (`"auto"`, `"tokens"`, `QuadraticCost` or callable, *optional*, defaults to `"auto"`):
            Sample cost as a function of length, see `odc_accelerate.planning.resolve_cost`.
        plan (`PlanName` or `str`: `"free"` or `"lockstep"`, *optional*, defaults to `"free"`):
            How each step is planned, see `odc_accelerate.planning.plan_step`.
        model_config (`PretrainedConfig`, *optional*):
            Model configuration for ``cost="auto"``.
        allow_oversize (`bool`, *optional*, defaults to `True`):
            With `False`, a sample longer than the budget raises a `ValueError` when its step is planned.
        padded (`bool`, *optional*, defaults to `False`):
            Whether the collator pads every row of a microbatch to its longest sequence; see
            `LengthBalancedBatchSampler`.
    """

    def __init__(
        self,
        world_size: int,
        samples_per_step: int,
        max_tokens_per_microbatch: int = 8192,
        cost: CostSpec | QuadraticCost = "auto",
        plan: PlanName | str = PlanName.FREE,
        *,
        model_config: Any = None,
        allow_oversize: bool = True,
        padded: bool = False,
    ) -> None:
        self.world_size = check_positive_int(world_size, "`world_size`")
        self.samples_per_step = check_positive_int(samples_per_step, "`samples_per_step`")
        if self.samples_per_step < self.world_size:
            raise ValueError(
                f"samples_per_step={samples_per_step} is smaller than world_size={world_size}, so some ranks would "
                "get no sample in any step. It counts samples per optimizer step over all ranks: set it to at "
                "least world_size (e.g. per-device batch size x world size)."
            )
        self.max_tokens_per_microbatch = check_positive_int(
            max_tokens_per_microbatch,
            "`max_tokens_per_microbatch` (the most tokens one forward/backward can hold in memory)",
        )
        self.plan_name = normalize_plan(plan)
        self.allow_oversize = bool(allow_oversize)
        self.padded = bool(padded)
        self._cost_fn = resolve_cost(cost, model_config)

    def plan(self, lengths: Sequence[int] | np.ndarray) -> Plan:
        """The plan of every rank for one step, as positions in ``lengths``.

        Args:
            lengths (`Sequence[int]`, `np.ndarray` or 2-D array of shape ``(samples, k)``):
                Token count of each sample of the step; a sample of ``k`` sequences that travel together (a DPO
                pair) is given as ``k`` lengths, as for `LengthBalancedBatchSampler`.
        """
        parts, totals = sample_parts(lengths)
        budget = self.max_tokens_per_microbatch
        if self.padded:
            # A sample of k sequences is k batch rows, each as wide as the longest of them.
            widths = parts.max(axis=1)
            rows = np.full(totals.size, parts.shape[1], dtype=np.int64)
            if not self.allow_oversize:
                check_oversize(rows * widths, budget)
            row_costs = check_costs(self._cost_fn(widths))
            return plan_padded(rows, widths, row_costs, self.world_size, budget, self.plan_name)
        if not self.allow_oversize:
            check_oversize(totals, budget)
        per_sequence = self._cost_fn(parts.reshape(-1)).reshape(parts.shape)
        costs = check_costs(np.asarray(per_sequence, dtype=np.float64).sum(axis=1))
        return plan_from_costs(costs, totals, self.world_size, budget, self.plan_name)

    def steps(
        self,
        stream: Iterable[Any],
        lengths_fn: LengthsFn | None = None,
        start_step: int = 0,
        passes: int | None = None,
    ) -> Iterator[StreamStep]:
        """Read ``stream`` ``samples_per_step`` samples at a time and yield each step with its plan.

        Args:
            stream (`Iterable`):
                The samples; iterated once per pass. If it has ``set_epoch`` (`datasets.IterableDataset`), it is
                called with the pass number before each pass, so that a shuffled stream draws a new order each
                pass, the same on every rank.
            lengths_fn (`Callable[[list], lengths]`, *optional*):
                The lengths of one step's samples (1-D, or ``(samples, k)`` for samples of ``k`` sequences). Defaults
                to `odc_accelerate.planning.dataset_lengths` on the rows (the ``"length"`` column if present, else
                the length of ``"input_ids"``).
            start_step (`int`, *optional*, defaults to 0):
                Steps to read and drop first (resuming after that many optimizer steps).
            passes (`int`, *optional*):
                Stop after this many passes; by default a new pass starts whenever one ends.
        """
        if isinstance(start_step, bool) or int(start_step) != start_step or start_step < 0:
            raise ValueError(f"`start_step` must be a non-negative integer, got {start_step!r}.")
        if passes is not None:
            passes = check_positive_int(passes, "`passes`")
        lengths_fn = lengths_fn or _default_lengths
        size = self.samples_per_step
        index = 0
        for pass_index in itertools.count():
            if passes is not None and pass_index >= passes:
                return
            if pass_index:
                logger.info("ODC: the training stream ended after %d steps; pass %d starts.", index, pass_index)
            set_epoch = getattr(stream, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(pass_index)
            samples = iter(stream)
            complete = 0
            while True:
                chunk = list(itertools.islice(samples, size))
                if len(chunk) < size:
                    break  # drop_last: a final incomplete step is left out of the pass
                complete += 1
                if index >= start_step:
                    yield StreamStep(index, pass_index, chunk, self._plan_chunk(chunk, lengths_fn, index))
                index += 1
            if not complete:
                what = "is empty" if not chunk else f"has only {len(chunk)} sample(s)"
                if pass_index and samples is stream:
                    fix = "Pass a dataset that can be read again (not a one-shot iterator), or train fewer steps."
                else:
                    fix = "Use a larger dataset or fewer samples per step."
                raise ValueError(
                    f"Pass {pass_index} over the training stream {what}, fewer than samples_per_step={size}: there "
                    f"is no complete optimizer step to train. {fix}"
                )

    def _plan_chunk(self, chunk: list[Any], lengths_fn: LengthsFn, index: int) -> Plan:
        try:
            lengths = lengths_fn(chunk)
            if np.asarray(lengths).shape[:1] != (len(chunk),):
                raise ValueError(
                    f"The length function gave {np.asarray(lengths).shape[0] if np.ndim(lengths) else 0} length(s) "
                    f"for {len(chunk)} samples."
                )
            return self.plan(lengths)
        except ValueError as err:
            # Numbered from 1, as the Trainer numbers optimizer steps.
            raise ValueError(f"Training stream, optimizer step {index + 1}: {err}") from err


def _default_lengths(chunk: list[Any]) -> np.ndarray:
    from .sampler import dataset_lengths

    return dataset_lengths(StepRows(chunk))
