"""`ODCKTOTrainer`: TRL's KTO (Kahneman-Tversky Optimization) with ODC (its arguments: `ODCKTOConfig`).

KTO's loss compares each example's log-ratio to a reference point ``z0``, an estimate of the KL divergence between
the policy and the reference from mismatched (prompt, completion) pairs. TRL estimates it in every microbatch and
averages it over ranks with a gather at the same accumulation index: a collective per microbatch, which a plan (ranks
running different numbers of microbatches) cannot have. Under a plan ``z0`` is estimated once per step, over every KL
pair of the step on every rank (a no-gradient pass over the rank's microbatches before them, summed in the step's one
all-reduce), and used in each of the step's microbatches.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from trl import KTOTrainer

from ..._compat import tested_text
from ..._compat import trl as trl_compat
from ..._compat.trl import kto as trl_kto
from ..._compat.trl import lm_head as trl_lm_head
from ...loss import batch_mean_weight
from ..trainer import ODCTrainerMixin
from ..trainer.budget import BudgetRule
from ..trainer.data import ZeroWeightMicrobatch
from ..trainer.metrics import StepMetrics
from .dpo import _shared_on_disk
from .reference import ODCReferenceModelMixin, check_reference_settings

logger = logging.getLogger(__name__)

__all__ = ["ODCKTOTrainer", "check_kto_settings", "finalize_kto_metrics", "kto_loss_weight"]

# What the step's all-reduce carries for KTO, after the step's counts (`ODCKTOTrainer._odc_step_sums`).
_STEP_SUMS = ("kl_sum", "kl_pairs", "num_chosen", "num_rejected")


def kto_loss_weight(examples: int, total_examples: float, world_size: int) -> float:
    """KTO averages its per-example losses (``nanmean``) over the examples of a microbatch: ``examples x W / examples
    of the whole step``, so the step's loss is the mean over every example of the global batch."""
    return batch_mean_weight(examples, total_examples, world_size)


def check_kto_settings(args: Any, config: Any) -> None:
    """Refuse, on every rank before any model is sharded, KTO settings that have no exact definition under ODC.

    Raises:
        ValueError: ``--odc_plan dynamic`` (the step's KL estimate is computed over the rank's microbatches before
            they run, which a dynamic plan knows only as it claims them).
    """
    check_reference_settings(args, config)
    from ...planning import PlanName

    if config.balanced and config.effective_plan == PlanName.DYNAMIC:
        raise ValueError(
            "odc_plan 'dynamic' is not supported for KTO: the step's KL estimate z0 and its counts of desirable and "
            "undesirable examples are computed over each rank's microbatches before the step's first one, and a "
            "dynamic plan knows a rank's microbatches only as it claims them. Use --odc_plan free (the default) or "
            "lockstep."
        )


def _check_vision(trainer: Any, config: Any) -> None:
    if config.balanced and trainer.calculate_KL and trl_kto.is_vision_dataset(trainer):
        raise ValueError(
            "KTO on a vision dataset is not supported under an ODC plan: TRL's vision collator pairs each prompt with "
            "the completion of its neighbour in the collated microbatch, and the plan chooses which examples share a "
            "microbatch, so the KL estimate would depend on the plan. Unpair and tokenize the data as text, use "
            "--loss_type apo_zero_unpaired (no KL estimate), or run without --odc / --odc_plan."
        )


class ODCKTOTrainer(ODCReferenceModelMixin, ODCTrainerMixin, KTOTrainer):
    """`trl.KTOTrainer` with ODC.

    * **KL pairs.** TRL's own: each example carries the completion its prompt is paired with for the KL estimate
      (``KL_completion_ids``, the completions rotated by one within consecutive blocks of
      ``per_device_train_batch_size`` prepared rows, in dataset order), whichever microbatch the plan puts it in.
    * **z0 per step.** Before a step's microbatches, a no-gradient pass over the rank's microbatches computes the
      policy's and the reference's log-probs of their KL sequences; the step's one all-reduce sums
      ``KL_logps - ref_KL_logps`` and the count of KL pairs over every rank, and ``z0 = max(sum / count, 0)`` enters
      every microbatch of the step. That is TRL's estimate over the whole global batch as one microbatch (TRL's own
      is per microbatch, over ``per_device_train_batch_size x world`` pairs). No KL forward runs in the microbatches.
    * **Exact loss.** TRL averages the desirable / undesirable losses over the examples of each microbatch
      (``losses.nanmean()``); each microbatch's loss is weighted by ``examples x W / examples of the step``, so the
      step's loss is the mean over every example of the global batch. A MoE router's auxiliary loss: each
      microbatch's term weighted by its share of the step's routed tokens (`odc_accelerate.integrations.trainer.moe`).
    * **Reference model** sharded per layer and served by a gather-only engine under ODC, or precomputed log-probs
      (``--precompute_ref_log_probs true``), as for DPO.
    * **Metrics.** TRL's gathers per microbatch are answered locally and reduced once per step: ``kl`` (the step's
      z0), entropy and logits as token-weighted values, rewards and log-probs as means over the step's desirable /
      undesirable examples, ``num_tokens`` over every rank, ``aux_loss`` as the share-weighted sum of the step.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        training_args = kwargs.get("args")
        if training_args is not None and getattr(training_args, "precompute_ref_log_probs", False):
            for key in ("train_dataset", "eval_dataset"):
                if kwargs.get(key) is not None:
                    kwargs[key] = _shared_on_disk(kwargs[key], training_args, key)
        self._odc_kto_step = dict.fromkeys(_STEP_SUMS, 0.0)
        self._odc_metric_marks: dict[str, int] = {}
        with (
            trl_kto.kto_reference_preparer(self._odc_prepare_reference),
            trl_lm_head.fused_lm_head_torch_path("kto"),  # TRL 1.15 on CPU
        ):
            super().__init__(*args, **kwargs)
        trl_kto.check_kto(self)
        _check_vision(self, self.odc_config)
        self._odc_release_dropped_reference()

    # ------------------------------------------------------------------ set-up
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        check_kto_settings(self.args, self.odc_config)

    # ------------------------------------------------------------------ planning
    def _odc_lengths(self, dataset: Any) -> Any:
        from ...planning import dataset_lengths

        prompt = dataset_lengths(dataset, length_column="prompt_ids")
        lengths = prompt + dataset_lengths(dataset, length_column="completion_ids")
        columns = list(getattr(dataset, "column_names", None) or [])
        if "KL_completion_ids" in columns:
            # The step's KL pass runs the KL sequences in the same microbatches: the longer of the two bounds both.
            lengths = np.maximum(lengths, prompt + dataset_lengths(dataset, length_column="KL_completion_ids"))
        max_length = getattr(self.args, "max_length", None)
        return np.minimum(lengths, max_length) if max_length else lengths  # the collator truncates to max_length

    def _odc_budget_rule(self, lengths: Any) -> BudgetRule:
        rule = super()._odc_budget_rule(lengths)
        return BudgetRule(
            default=rule.default,
            oversize=rule.oversize,
            sample="example (prompt + completion, or prompt + KL completion if longer)",
            remedy=rule.remedy,
        )

    def _odc_num_items(self, microbatches: list[Any]) -> int:
        return sum(int(mb["input_ids"].shape[0]) for mb in microbatches)  # examples

    # ------------------------------------------------------------------ the step's KL estimate
    def _odc_step_sums(self, microbatches: list[Any]) -> list[float]:
        """This rank's share of the step's KL estimate and example counts, summed over ranks in the step's all-reduce.

        Every microbatch runs the KL forwards (a zero-weight one of a lockstep plan too, so that plain FSDP2's
        per-layer collectives pair up across ranks); only the weighted ones count.
        """
        kl_sum, pairs, chosen, rejected = 0.0, 0.0, 0.0, 0.0
        for mb in microbatches:
            zero_weight = isinstance(mb, ZeroWeightMicrobatch)
            batch = self._prepare_inputs(mb.batch if zero_weight else mb)
            labels = batch["label"]
            if self.calculate_KL:
                with self.odc_step_timer.compute(self.args.device), torch.no_grad():
                    kl = trl_kto.policy_kl_logps(self, batch) - trl_kto.reference_kl_logps(self, batch)
                if not zero_weight:
                    kl_sum += float(kl.double().sum())
                    pairs += kl.numel()
            if not zero_weight:
                chosen += float(labels.sum())
                rejected += float(len(labels) - labels.sum())
        return [kl_sum, pairs, chosen, rejected]

    def _odc_step_reduced(self, sums: list[float]) -> None:
        self._odc_kto_step = dict(zip(_STEP_SUMS, sums, strict=True))

    @property
    def odc_step_kl(self) -> float:
        """The step's KL estimate before TRL's clamp at 0: the mean of ``KL_logps - ref_KL_logps`` over every KL pair
        of the step on every rank."""
        step = self._odc_kto_step
        return step["kl_sum"] / step["kl_pairs"] if step["kl_pairs"] else 0.0

    # ------------------------------------------------------------------ loss and metrics
    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        if isinstance(inputs, list):  # a planned step: what TRL records in it is replaced at its end
            self._odc_metric_marks = {key: len(v) for key, v in trl_compat.train_metrics(self).items()}
        return super().training_step(model, inputs, num_items_in_batch)

    # A router's auxiliary loss: each microbatch's term weighted by its share of the step's routed tokens (`moe`).
    _odc_serves_router_aux_loss = True

    @property
    def _odc_aux_gather_position(self) -> int:  # type: ignore[override]
        # TRL gathers aux_loss last, after the reward and log-prob gathers the step's counts decide
        return len(self._odc_step_gathers()) - 1

    def _odc_step_gathers(self) -> tuple[str, ...]:
        """The metric gathers of each microbatch of the current step (`trl_kto.kto_gathers` for its counts)."""
        step = self._odc_kto_step
        return trl_kto.kto_gathers(self, chosen=step["num_chosen"] > 0, rejected=step["num_rejected"] > 0)

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):
        if not (self._odc_looping and num_items_in_batch is not None):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        step = self._odc_kto_step
        if self.calculate_KL and "ref_KL_logps" in inputs:
            inputs = {**inputs, "ref_KL_logps": torch.zeros_like(inputs["ref_KL_logps"])}  # see `step_kl_answers`
        weight = kto_loss_weight(
            int(inputs["input_ids"].shape[0]), float(num_items_in_batch), self.accelerator.num_processes
        )
        # TRL adds coef x aux to the examples' mean, which the weight then multiplies: the router term's weighted share
        # of the step needs coef x share x W / weight (`moe`).
        with (
            trl_kto.step_kl_answers(self, self.odc_step_kl, step["num_chosen"], step["num_rejected"]),
            self._odc_router_coef(self.accelerator.num_processes / weight),
        ):
            out = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        return (out[0] * weight, *out[1:]) if return_outputs else out * weight

    def _odc_finalize_metrics(self, metrics: StepMetrics) -> None:
        names = self._odc_step_gathers()
        if metrics.gathers_per_microbatch != len(names):
            logger.warning(
                "ODC: KTO made %d metric gathers per microbatch, expected %d (tested with TRL %s); metrics of this "
                "step are local.",
                metrics.gathers_per_microbatch,
                len(names),
                tested_text("trl"),
            )
            return
        finalize_kto_metrics(self, metrics, names)


def finalize_kto_metrics(trainer: ODCKTOTrainer, metrics: StepMetrics, names: tuple[str, ...]) -> None:
    """KTO: ``kl`` is the step's z0; entropy and logits are ratios of global sums over the step's completion tokens;
    rewards and log-probs are means over the step's desirable / undesirable examples on every rank; ``num_tokens``
    counts the input tokens of all ranks: the values TRL logs when the global batch is one microbatch; ``aux_loss``
    is the sum of each microbatch's term weighted by its share of the step's routed tokens."""
    total = dict(zip(names, metrics.global_sums, strict=False))
    mine = dict(zip(names, metrics.local_sums, strict=False))
    recorded = trl_compat.train_metrics(trainer)
    marks = trainer._odc_metric_marks
    for key in trl_kto.KTO_PER_MICROBATCH:
        if key in recorded:
            del recorded[key][marks.get(key, 0) :]
    values = {"kl": max(trainer.odc_step_kl, 0.0) if trainer.calculate_KL else 0.0}
    values["entropy"] = total["entropy_sum"] / total["entropy_tokens"] if total["entropy_tokens"] > 0 else 0.0
    for side in ("chosen", "rejected"):
        if total[f"{side}_tokens"] > 0:
            values[f"logits/{side}"] = total[f"{side}_logits_sum"] / total[f"{side}_tokens"]
        examples = total[f"num_{side}"]
        if examples > 0:
            values[f"rewards/{side}"] = total[f"rewards/{side}"] / examples
            values[f"logps/{side}"] = total[f"logps/{side}"] / examples
    if "rewards/chosen" in values and "rewards/rejected" in values:
        values["rewards/margins"] = values["rewards/chosen"] - values["rewards/rejected"]
    if "aux_loss" in names:  # weighted by each microbatch's share of the step's routed tokens: their sum
        values["aux_loss"] = total["aux_loss"]
    for key, value in values.items():
        recorded[key].append(float(value))
    trl_compat.count_train_tokens(trainer, total["num_tokens"], mine["num_tokens"])
