"""The balanced step's data path: one dataloader item is one rank's whole optimizer step (its microbatches).

A map-style dataset is fetched through `StepDataset` with the `LengthBalancedBatchSampler`'s index lists; a stream
(`datasets.IterableDataset`) through `StreamStepDataset`, which reads the stream and plans each step as it comes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

__all__ = [
    "PaddedRows",
    "SequenceBoundaries",
    "StepCollator",
    "StepDataLoader",
    "StepDataset",
    "StreamStepDataset",
    "ZeroWeightMicrobatch",
    "input_tokens",
    "merge_for_counting",
    "microbatch_rows",
]


class StepDataLoader(DataLoader):
    """A DataLoader whose items are whole steps; it skips on resume through its sampler (see the mixin's
    ``_run_epoch``)."""

    # Tells the transformers compat module's skip_first_batches pass-through to leave this loader alone.
    _odc_skips_itself = True


class StepDataset(Dataset):
    """Fetches a whole step: ``dataset[[[i, j], [k]]]`` -> ``[[row_i, row_j], [row_k]]``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, microbatches: list[list[int]]) -> list[list[Any]]:
        return [[self.dataset[i] for i in mb] for mb in microbatches]


class StreamStepDataset(IterableDataset):
    """Reads a stream and yields, per optimizer step, this rank's microbatches of rows: ``[[row, row], [row]]``.

    Every rank reads the whole stream in the same order: step ``k`` is its ``k``-th run of ``samples_per_step`` rows,
    planned by a `odc_accelerate.planning.StreamingStepPlanner`, and each rank keeps its own microbatches. The
    stream is read in the main process (``num_workers=0``): in a dataloader worker a `datasets.IterableDataset`
    reads only that worker's shards.

    Args:
        stream (`Iterable[dict]`):
            The training rows (`datasets.IterableDataset` or any re-iterable of dicts).
        planner (`StreamingStepPlanner`):
            Plans each step.
        rank (`int`):
            This process's rank.
        lengths_fn (`Callable[[list[dict]], lengths]`):
            The lengths of one step's rows, as for `StreamingStepPlanner.steps`.
        columns (`Sequence[str]`, *optional*):
            Keep only these columns of each row (the Trainer's unused-column removal); all by default.
        queue (`bool`, *optional*, defaults to `False`):
            Yield the step's whole queue (`StreamStep.queue`, the ``dynamic`` plan) as a `dynamic.ClaimQueue` of rows
            instead of this rank's microbatches.

    Attributes:
        start_step (`int`): the step the next iteration starts at (set before iterating to resume).
        steps_consumed (`int`): steps handed out so far, counted from the start of the stream.
    """

    def __init__(
        self,
        stream: Iterable[dict],
        planner: Any,
        rank: int,
        lengths_fn: Callable[[list[dict]], Any],
        columns: Sequence[str] | None = None,
        queue: bool = False,
    ) -> None:
        self.stream = stream
        self.queue = queue
        self.planner = planner
        self.rank = int(rank)
        self.lengths_fn = lengths_fn
        self.columns = None if columns is None else list(columns)
        self.start_step = 0
        self.steps_consumed = 0

    def __iter__(self) -> Iterator[Any]:
        if get_worker_info() is not None:
            raise RuntimeError(
                "A streamed ODC training set is read in the main process, not in dataloader workers: set "
                "--dataloader_num_workers 0."
            )
        source = _SelectColumns(self.stream, self.columns) if self.columns is not None else self.stream
        start, self.start_step = self.start_step, 0
        self.steps_consumed = start
        for step in self.planner.steps(source, self.lengths_fn, start_step=start):
            # Counted before the hand-over: the step being trained is included.
            self.steps_consumed = step.index + 1
            if self.queue:
                from .dynamic import ClaimQueue

                yield ClaimQueue(step.queue(), rows=True)
            else:
                yield step.microbatches(self.rank)


class _SelectColumns:
    """A stream's rows restricted to some columns; forwards ``set_epoch``."""

    def __init__(self, stream: Iterable[dict], columns: Sequence[str]) -> None:
        self.stream = stream
        self.columns = list(columns)

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.stream, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __iter__(self) -> Iterator[dict]:
        for row in self.stream:
            yield {k: row[k] for k in self.columns if k in row}


@dataclass(frozen=True, slots=True)
class ZeroWeightMicrobatch:
    """A collated microbatch that runs its forward and backward at loss weight 0 (see `StepCollator`).

    The step loop (`ODCStepLoop.training_step`) scales its loss by 0 before the backward, leaves it out of the step's
    loss, its count of loss items, its input tokens and the metrics' global values; only its compute remains.
    """

    batch: Any


class StepCollator:
    """Collates each microbatch of a step with the trainer's own collator.

    An empty microbatch (a slot of the ``lockstep`` plan that a step too small for its slots cannot fill) is dropped,
    or with ``pad_empty=True`` becomes a `ZeroWeightMicrobatch` of one of the rank's own samples of the step (the
    last of its last non-empty microbatch). Plain FSDP2 (ODC off) needs that: its per-layer collectives pair the
    microbatches of all ranks, so every rank must run as many as the plan has slots; the zero weight keeps the
    gradient, loss and metrics those of the real samples exactly. With ODC ranks need not meet per microbatch.

    Args:
        collator: the trainer's ``data_collator``.
        pad_empty (`bool`, *optional*, defaults to `False`): keep empty slots as zero-weight microbatches.
    """

    def __init__(self, collator: Any, pad_empty: bool = False) -> None:
        self.collator = collator
        self.pad_empty = pad_empty

    def __call__(self, step: list[list[Any]]) -> list[Any]:
        if not self.pad_empty or all(step):
            return [self.collator(features) for features in step if features]
        filler = next((features[-1:] for features in reversed(step) if features), None)
        if filler is None:
            raise RuntimeError(
                f"This rank's step has {len(step)} microbatch slots and no sample, so it has nothing to run in step with "
                "the other ranks' collectives. Raise --odc_samples_per_step to at least the world size."
            )
        return [self.collator(f) if f else ZeroWeightMicrobatch(self.collator(filler)) for f in step]


class PaddedRows:
    """Collates a microbatch with a packing collator (`transformers.DataCollatorWithFlattening`) as one row per sample:
    each sample collated alone, the rows right-padded (input ids with ``pad_token_id``, labels with -100, position ids
    with 0) under an attention mask. The labels and their count are those of the packed row; what differs is that no
    layer sees one sample's tokens from another (see `odc_accelerate.hybrid`). Boundary keys (``cu_seq_lens_*``,
    ``max_length_*``, ``seq_idx``) are left out: one row holds one sample."""

    PADDING = {"input_ids": None, "labels": -100, "position_ids": 0}

    def __init__(self, collator: Any, pad_token_id: int = 0) -> None:
        self.collator = collator
        self.pad_token_id = int(pad_token_id)

    def __call__(self, features: list[Any]) -> dict:
        rows = [self.collator([feature]) for feature in features]
        width = max(int(row["input_ids"].shape[1]) for row in rows)
        out = {}
        for key, fill in self.PADDING.items():
            if key in rows[0]:
                value = self.pad_token_id if fill is None else fill
                out[key] = torch.cat([_pad_right(row[key], width, value) for row in rows])
        out["attention_mask"] = torch.cat([_pad_right(torch.ones_like(row["input_ids"]), width, 0) for row in rows])
        return out


def _pad_right(row: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return torch.nn.functional.pad(row, (0, width - row.shape[1]), value=value)


class SequenceBoundaries:
    """A packing collator whose rows also carry the sequence boundaries recurrent kernels read
    (`odc_accelerate.hybrid.with_sequence_boundaries`)."""

    def __init__(self, collator: Any) -> None:
        self.collator = collator

    def __call__(self, features: list[Any]) -> dict:
        from ...hybrid import with_sequence_boundaries

        return with_sequence_boundaries(self.collator(features))


def input_tokens(batch: dict) -> int:
    """Non-padding input tokens of a collated batch."""
    if "attention_mask" in batch and batch["attention_mask"] is not None:
        return int(batch["attention_mask"].sum())
    if "position_ids" in batch:
        return int(batch["position_ids"].numel())
    ids = batch.get("input_ids")
    return int(ids.numel()) if ids is not None else 0


def microbatch_rows(batch: dict) -> int:
    """The samples of a collated microbatch: its rows, or in one packed row (``DataCollatorWithFlattening``: no
    attention mask, ``position_ids`` restarting at 0 for each sequence) its sequences."""
    if "cu_seq_lens_q" in batch:
        return int(batch["cu_seq_lens_q"].numel()) - 1
    position_ids = batch.get("position_ids")
    if batch.get("attention_mask") is None and position_ids is not None and position_ids.shape[0] == 1:
        return int((position_ids == 0).sum())
    ids = batch.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() > 0:
        return int(ids.shape[0])
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 0


def merge_for_counting(microbatches: list[dict], main: str) -> dict:
    """One batch holding every microbatch's ``main`` input (and attention mask), for the Trainer's token count."""
    if not microbatches:
        return {main: torch.zeros(0, dtype=torch.long)}
    out = {main: torch.cat([mb[main].reshape(-1) for mb in microbatches])}
    if all("attention_mask" in mb for mb in microbatches):
        out["attention_mask"] = torch.cat([mb["attention_mask"].reshape(-1) for mb in microbatches])
    return out
