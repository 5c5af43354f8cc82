"""What ODC's preference-pair trainers share (DPO, reward): a pair is one planned sample of two batch rows, chosen and
rejected, which TRL's collator pads to the longest row of the microbatch; TRL's loss is a mean over a microbatch's
pairs, weighted here by its share of the step's pairs."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ...loss import batch_mean_weight
from ..trainer.budget import BudgetRule
from ..trainer.data import microbatch_rows

__all__ = ["ODCPairTrainerMixin", "pair_budget_tokens", "pair_lengths", "pair_loss_weight"]


def pair_lengths(chosen: Any, rejected: Any) -> np.ndarray:
    """The lengths of preference pairs as the planner counts them: ``(pairs, 2)``, chosen then rejected."""
    return np.stack([np.asarray(chosen, dtype=np.int64), np.asarray(rejected, dtype=np.int64)], axis=1)


def pair_budget_tokens(lengths: Any, packed: bool = False) -> np.ndarray:
    """The tokens each pair holds in a microbatch: both rows padded to the longer, so a pair alone is 2 x its longer
    sequence; packed into one row (DPO's ``padding_free``), the sum of its two."""
    lengths = np.asarray(lengths)
    return lengths.sum(axis=1) if packed else 2 * lengths.max(axis=1)


def pair_loss_weight(pairs: int, total_pairs: float, world_size: int) -> float:
    """A microbatch's mean over its pairs becomes its share of the step's mean: ``pairs x W / pairs of the whole
    step``."""
    return batch_mean_weight(pairs, total_pairs, world_size)


class ODCPairTrainerMixin:
    """The planning and loss weight of a preference-pair trainer; put it before `ODCTrainerMixin` in the bases. The
    trainer reads each pair's lengths (`_odc_lengths`, with `pair_lengths`) and names its pair for the budget messages
    (``odc_pair_sample``, ``odc_pair_remedy``)."""

    #: A pair, and what else fits it in the token budget, for the budget's messages (`..trainer.budget`).
    odc_pair_sample: ClassVar[str] = "pair (chosen and rejected, both padded to the longer)"
    odc_pair_remedy: ClassVar[str] = "lower --max_length"
    #: Whether a microbatch's pairs are packed into one row (the DPO trainer's ``padding_free``), not padded.
    odc_packs_pairs: bool = False

    def _odc_budget_tokens(self, lengths: Any) -> np.ndarray:
        return pair_budget_tokens(lengths, packed=self.odc_packs_pairs)

    def _odc_budget_rule(self, lengths: Any) -> BudgetRule:
        max_length = getattr(self.args, "max_length", None)
        return BudgetRule(
            default=2 * int(max_length) if max_length else int(self._odc_budget_tokens(lengths).max()),
            oversize="raise",
            sample=self.odc_pair_sample,
            remedy=self.odc_pair_remedy,
        )

    def _odc_num_items(self, microbatches: list[Any]) -> int:
        # pairs: [chosen; rejected] rows, or sequences of a packed row (DPO's padding_free)
        return sum(microbatch_rows(mb) // 2 for mb in microbatches)

    def _odc_queue_items(self, step: Any) -> int:
        # A dynamic step's pairs are its samples: counted from the queue, nothing is collated before the claims.
        return sum(len(mb) for mb in step.queue.microbatches)

    def _odc_pair_weight(self, inputs: Any, num_items_in_batch: Any) -> float:
        """The loss weight of the microbatch ``inputs`` (``num_items_in_batch``: the step's pairs, all ranks)."""
        pairs = microbatch_rows(inputs) // 2
        return pair_loss_weight(pairs, float(num_items_in_batch), self.accelerator.num_processes)
