"""`ODCRewardTrainer`: TRL's `RewardTrainer` (outcome reward models) with ODC."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from trl import RewardTrainer

from ..._compat import tested_text
from ..._compat.trl import reward as reward_compat
from ..trainer import ODCTrainerMixin
from ..trainer.budget import BudgetRule
from ..trainer.metrics import StepMetrics
from .loss import reward_loss_weight
from .metrics import REWARD_ODC_GATHERS, finalize_reward_metrics

logger = logging.getLogger(__name__)

__all__ = ["ODCRewardTrainer", "reward_pair_lengths"]


def reward_pair_lengths(chosen: Any, rejected: Any) -> np.ndarray:
    """The lengths of preference pairs as the planner counts them: ``(pairs, 2)``, chosen then rejected.

    TRL's reward data already holds the prompt in both sequences (``chosen_ids``, ``rejected_ids``), and pairs with a
    side over ``max_length`` are dropped rather than truncated, so the token counts are the columns' own.
    """
    return np.stack([np.asarray(chosen, dtype=np.int64), np.asarray(rejected, dtype=np.int64)], axis=1)


def reward_pair_budget_tokens(lengths: Any) -> np.ndarray:
    """The tokens each pair holds in a microbatch: TRL's collator pads chosen and rejected rows to the longest of the
    microbatch, so a pair alone is 2 x its longer sequence."""
    return 2 * np.asarray(lengths).max(axis=1)


class ODCRewardTrainer(ODCTrainerMixin, RewardTrainer):
    """`trl.RewardTrainer` with ODC: a sequence-classification model (``num_labels=1``) scores the chosen and rejected
    sequence of each preference pair.

    * **Planning.** A pair is one sample of the length-balanced sampler with two batch rows, chosen and rejected (TRL
      prepends the prompt to both). TRL's collator pads every row of a microbatch to its longest sequence, so the plan
      is made on padded shapes: pairs of similar lengths share a microbatch, which holds at most the token budget of
      padded tokens (default ``2 x max_length``, one longest pair). A pair is never split.
    * **Exact loss.** TRL averages ``-logsigmoid(r_chosen - r_rejected [- margin])`` (and the optional
      ``center_rewards_coefficient`` term) over the pairs of each microbatch; here each microbatch's loss is reweighted
      by ``pairs in the microbatch x world size / pairs of the whole step``, so the step's gradient is that of the mean
      over every pair of the global batch, whatever the per-rank split.
    * **Metrics.** TRL's 4 gathers per microbatch are answered locally and reduced once per step, with the ODC step
      metrics: ``min_reward`` / ``mean_reward`` / ``max_reward`` over every reward of the step, ``accuracy`` and
      ``margin`` as means over every pair of the step (TRL gathers one mean per rank; with ranks running different
      numbers of pairs the step's value is weighted by pairs, the value one process logs for the whole global batch),
      and ``num_tokens`` counting every rank's input tokens. A rank with no pair in a step joins the step's one
      reduction with nothing.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        reward_compat.check_reward(self)

    # ------------------------------------------------------------------ planning
    def _odc_lengths(self, dataset: Any) -> Any:
        from ...planning import dataset_lengths

        return reward_pair_lengths(
            dataset_lengths(dataset, length_column="chosen_ids"),
            dataset_lengths(dataset, length_column="rejected_ids"),
        )

    def _odc_budget_tokens(self, lengths: Any) -> np.ndarray:
        return reward_pair_budget_tokens(lengths)

    def _odc_budget_rule(self, lengths: Any) -> BudgetRule:
        max_length = getattr(self.args, "max_length", None)
        return BudgetRule(
            default=2 * int(max_length) if max_length else int(self._odc_budget_tokens(lengths).max()),
            oversize="raise",
            sample="pair (chosen and rejected, both padded to the longer)",
            remedy="lower --max_length (longer pairs are dropped)",
        )

    def _odc_num_items(self, microbatches: list[Any]) -> int:
        return sum(int(mb["input_ids"].shape[0]) // 2 for mb in microbatches)  # pairs: [chosen; rejected] rows

    def _odc_queue_items(self, step: Any) -> int:
        # A dynamic step's pairs are its samples: counted from the queue, nothing is collated before the claims.
        return sum(len(mb) for mb in step.queue.microbatches)

    # ------------------------------------------------------------------ loss and metrics
    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):
        if not (self._odc_looping and num_items_in_batch is not None):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        with torch.no_grad():
            # Per pair, so the step's accuracy and margin are means over its pairs (TRL gathers one mean per rank).
            # Answered locally and recorded like TRL's own gathers (see `REWARD_ODC_GATHERS`).
            chosen, rejected = torch.chunk(outputs.logits.squeeze(-1), chunks=2)
            self.accelerator.gather_for_metrics((chosen > rejected).float())
            self.accelerator.gather_for_metrics(chosen - rejected)
        pairs = int(inputs["input_ids"].shape[0]) // 2
        loss = loss * reward_loss_weight(pairs, float(num_items_in_batch), self.accelerator.num_processes)
        return (loss, outputs) if return_outputs else loss

    def _odc_finalize_metrics(self, metrics: StepMetrics) -> None:
        expected = len(reward_compat.REWARD_TRAIN_GATHERS) + len(REWARD_ODC_GATHERS)
        if metrics.gathers_per_microbatch != expected:
            logger.warning(
                "ODC: the reward trainer made %d metric gathers per microbatch, expected %d (tested with TRL %s); "
                "metrics of this step are local.",
                metrics.gathers_per_microbatch,
                expected,
                tested_text("trl"),
            )
            return
        finalize_reward_metrics(self, metrics)
