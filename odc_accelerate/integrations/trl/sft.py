"""`ODCSFTTrainer`: TRL's `SFTTrainer` with ODC."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from trl import SFTTrainer

from ..._compat import trl as trl_compat
from ..._compat.trl import lm_head as trl_lm_head
from ..._compat.trl import sft as trl_sft
from ..trainer import ODCTrainerMixin
from ..trainer.metrics import StepMetrics
from ..trainer.plain import check_average_tokens
from .metrics import drop_microbatch_values, ratio

__all__ = ["ODCSFTTrainer", "check_sft_packing", "finalize_sft_metrics", "vision_sample_length"]


def vision_sample_length(collator: Any, row: Any) -> int:
    """The tokens of one image+text sample as the model sees them: the sample collated alone by TRL's vision collator,
    whose processor expands each image placeholder to the image's tokens (and truncates to ``max_length``)."""
    from ..trainer.data import input_tokens

    return input_tokens(collator([dict(row)]))  # a copy: TRL's collator renames the row's "image" key in place


def check_sft_packing(trainer: Any) -> None:
    """Refuse, on every rank before the model is sharded, padding-free SFT (``padding_free``, or ``packing`` with
    the ``bfd`` strategies, which imply it) of a model with recurrent layers where the kernels that keep packed
    samples apart are not installed: TRL's collator passes the sequence boundaries, and transformers' fallback would
    raise on them in the first forward (see `odc_accelerate.hybrid`).

    Raises:
        `ValueError`: naming the setting, the packages to install, and how to train padded.
    """
    from ...hybrid import packing_refusal

    args = trainer.args
    if not getattr(trainer, "padding_free", False) or getattr(trainer, "model", None) is None:
        return
    packing = getattr(args, "packing", False)
    setting = f"--packing true (strategy {args.packing_strategy})" if packing else "--padding_free true"
    remedy = "pass --packing false" if packing else "pass --padding_free false (the default)"
    message = packing_refusal(trainer.model, setting, remedy)
    if message is not None:
        raise ValueError(message)


class ODCSFTTrainer(ODCTrainerMixin, SFTTrainer):
    """`trl.SFTTrainer` with ODC: unequal microbatch counts per rank, exact token-mean loss, no collective inside a
    step (TRL's per-microbatch metric gathers are reduced once per step), per-step ODC metrics in the logs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        with contextlib.ExitStack() as stack:
            stack.enter_context(trl_lm_head.fused_lm_head_torch_path("sft"))  # TRL 1.15 on CPU
            if (
                training_args is not None
                and getattr(training_args, "padding_free", False)
                and not getattr(training_args, "packing", False)
                and getattr(training_args, "max_length", None) is not None
                and self._odc_resolve_early(training_args).balanced  # the options the trainer then runs with
            ):
                # The balanced plan bounds each padding-free microbatch by its token budget: samples are truncated to
                # max_length as usual (TRL alone refuses padding_free with max_length and no packing).
                stack.enter_context(trl_sft.sft_padding_free_with_max_length(self, training_args))
            super().__init__(*args, **kwargs)
        trl_sft.check_sft(self)

    # A router's auxiliary loss: each microbatch's term weighted by its share of the step's routed tokens (`moe`);
    # TRL gathers it after its four token metrics.
    _odc_serves_router_aux_loss = True
    _odc_aux_gather_position = len(trl_sft.SFT_TRAIN_GATHERS)

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):
        # TRL adds coef x aux / current_gradient_accumulation_steps after multiplying its token loss by the world
        # size: the weighted share then needs coef x share x W x those steps (one under a plan).
        scale = self.accelerator.num_processes * self.current_gradient_accumulation_steps
        with self._odc_router_coef(scale):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _odc_lengths(self, dataset: Any) -> Any:
        if not trl_sft.is_vision_dataset(self):
            return super()._odc_lengths(dataset)
        # An image+text sample's tokens are known only once the processor expanded its image placeholders: the plan
        # (cost and token budget) counts them by collating each sample alone, once.
        from ...planning import dataset_lengths

        return dataset_lengths(dataset, length_fn=functools.partial(vision_sample_length, self.data_collator))

    def _odc_check_settings(self, config: Any) -> None:
        super()._odc_check_settings(config)
        check_sft_packing(self)
        if config.balanced:
            # TRL's loss divides by num_items_in_batch (the step's label tokens over all ranks under a plan) and
            # multiplies by the number of processes only with the flag on.
            check_average_tokens(self, "SFTTrainer's loss")

    def _odc_finalize_metrics(self, metrics: StepMetrics) -> None:
        finalize_sft_metrics(self, metrics)


def finalize_sft_metrics(trainer: Any, metrics: StepMetrics) -> None:
    """SFT: ``entropy`` and ``mean_token_accuracy`` become token-weighted values over every label token of the step on
    every rank; ``num_tokens`` counts the input tokens of all ranks."""
    names = trl_sft.SFT_TRAIN_GATHERS
    total = dict(zip(names, metrics.global_sums, strict=False))
    mine = dict(zip(names, metrics.local_sums, strict=False))
    recorded = trl_compat.train_metrics(trainer)
    drop_microbatch_values(recorded, ("entropy", "mean_token_accuracy"), metrics.local_microbatches)
    recorded["entropy"].append(ratio(total["entropy_sum"], total["num_valid"]))
    recorded["mean_token_accuracy"].append(ratio(total["num_correct"], total["num_valid"]))
    trl_compat.count_train_tokens(trainer, total["num_tokens"], mine["num_tokens"])
    if getattr(trainer, "aux_loss_enabled", False) and len(metrics.global_sums) > len(names):
        # Each microbatch's value was weighted by its share of the step's routed tokens: the step's is their sum.
        drop_microbatch_values(recorded, ("aux_loss",), metrics.local_microbatches)
        recorded["aux_loss"].append(float(metrics.global_sums[len(names)]))
