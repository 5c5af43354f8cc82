"""`ODCRewardTrainer`: TRL's `RewardTrainer` (outcome reward models) with ODC."""

from __future__ import annotations

from typing import Any

import torch
from trl import RewardTrainer

from ..._compat import trl as trl_compat
from ..._compat.trl import reward as reward_compat
from ..trainer import ODCTrainerMixin
from ..trainer.metrics import StepMetrics
from .metrics import check_gathers, drop_microbatch_values, ratio
from .pairs import ODCPairTrainerMixin, pair_lengths

__all__ = ["REWARD_ODC_GATHERS", "ODCRewardTrainer", "finalize_reward_metrics"]

#: The gathers `ODCRewardTrainer` adds after TRL's own in each microbatch (answered locally, never a collective): each
#: pair's accuracy (chosen scored above rejected) and margin (chosen minus rejected), so that the step's values are
#: means over its pairs.
REWARD_ODC_GATHERS = ("correct_pairs", "pair_margins")


class ODCRewardTrainer(ODCPairTrainerMixin, ODCTrainerMixin, RewardTrainer):
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

    odc_pair_remedy = "lower --max_length (longer pairs are dropped)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        reward_compat.check_reward(self)

    # ------------------------------------------------------------------ planning
    def _odc_lengths(self, dataset: Any) -> Any:
        from ...planning import dataset_lengths

        # TRL's reward data holds the prompt in both sequences, and drops (does not truncate) a pair over max_length.
        return pair_lengths(
            dataset_lengths(dataset, length_column="chosen_ids"),
            dataset_lengths(dataset, length_column="rejected_ids"),
        )

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
        loss = loss * self._odc_pair_weight(inputs, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def _odc_finalize_metrics(self, metrics: StepMetrics) -> None:
        expected = len(reward_compat.REWARD_TRAIN_GATHERS) + len(REWARD_ODC_GATHERS)
        if check_gathers("the reward trainer", metrics, expected):
            finalize_reward_metrics(self, metrics)


def finalize_reward_metrics(trainer: Any, metrics: StepMetrics) -> None:
    """Reward model: ``min_reward`` / ``mean_reward`` / ``max_reward`` over every reward (chosen and rejected) of the
    step on every rank, ``accuracy`` and ``margin`` means over every pair of the step, ``num_tokens`` counting the
    input tokens of all ranks: the values TRL logs when the global batch is one microbatch."""
    names = reward_compat.REWARD_TRAIN_GATHERS + REWARD_ODC_GATHERS
    total = dict(zip(names, metrics.global_sums, strict=False))
    count = dict(zip(names, metrics.global_counts, strict=False))
    mine = dict(zip(names, metrics.local_sums, strict=False))
    index = {name: i for i, name in enumerate(names)}
    recorded = trl_compat.train_metrics(trainer)
    drop_microbatch_values(recorded, reward_compat.REWARD_PER_MICROBATCH, metrics.local_microbatches)
    values = {
        "min_reward": metrics.global_mins[index["rewards"]],
        "mean_reward": ratio(total["rewards"], count["rewards"]),
        "max_reward": metrics.global_maxs[index["rewards"]],
        "accuracy": ratio(total["correct_pairs"], count["correct_pairs"]),
        "margin": ratio(total["pair_margins"], count["pair_margins"]),
    }
    for key, value in values.items():
        recorded[key].append(float(value))
    trl_compat.count_train_tokens(trainer, total["num_tokens"], mine["num_tokens"])
