"""The ``dynamic`` plan in the ODC Trainer: ranks claim the step's microbatches while the step runs.

Every rank's dataloader item is the step's whole queue (`ClaimQueue`), costliest first, nothing fetched yet; the step
loop claims the next index (`ODCEngine.claim_microbatches`) when the rank is free, after the previous microbatch's
backward, then loads and collates only that microbatch (`ClaimedStep`). The step's loss items are counted before the
first claim (from the queue, or a ``1/W`` share collated per rank and one all-reduce). A rank learns that a microbatch
was its last only at its next claim, so the engine's memory policy decides what syncing after each one means. See
docs/planning.md ("dynamic").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset

__all__ = ["ClaimQueue", "ClaimedStep", "QueueDataset", "keep_queue"]


@dataclass
class ClaimQueue:
    """One step's queue of microbatches, in claim order: index lists into a dataset (``rows=False``) or lists of rows.

    What the dataloader yields under the ``dynamic`` plan: small and picklable (nothing is fetched yet).
    """

    microbatches: list[list[Any]]
    rows: bool = False

    def __len__(self) -> int:
        return len(self.microbatches)


class QueueDataset(Dataset):
    """A map-style dataset's steps as `ClaimQueue` items (the sampler yields the queue; no row is fetched here)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, microbatches: list[list[int]]) -> ClaimQueue:
        return ClaimQueue([list(mb) for mb in microbatches])


def keep_queue(item: ClaimQueue) -> ClaimQueue:
    """The dataloader's collate function for queues: collation happens on claim."""
    return item


class ClaimedStep(list):
    """A step of the ``dynamic`` plan on one rank: the queue, and (as the list itself) the collated microbatches this
    rank claimed so far, in the order it ran them.

    Args:
        queue (`ClaimQueue`): the step's queue.
        load (`Callable[[list], Any]`): fetches and collates one microbatch of the queue.
    """

    def __init__(self, queue: ClaimQueue, load: Callable[[list[Any]], Any]) -> None:
        super().__init__()
        self.queue = queue
        self._load = load
        self._counted: dict[int, Any] = {}

    def peek(self, index: int) -> Any:
        """Microbatch ``index`` collated without claiming it (for counting loss items); kept for a later claim."""
        if index not in self._counted:
            self._counted[index] = self._load(self.queue.microbatches[index])
        return self._counted[index]

    def claimed(self, indices: Iterator[int] | range) -> Iterator[Any]:
        """Collate each claimed index as it comes (lazily: the next claim is made when the caller asks for it)."""
        for index in indices:
            batch = self._counted.pop(index, None)
            if batch is None:
                batch = self._load(self.queue.microbatches[index])
            self.append(batch)
            yield batch
        self._counted.clear()
