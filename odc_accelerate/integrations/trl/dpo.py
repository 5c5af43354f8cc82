"""`ODCDPOTrainer`: TRL's `DPOTrainer` with ODC."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from trl import DPOTrainer

from ..._compat import tested_text
from ..._compat.trl import dpo as trl_dpo
from ..._compat.trl import lm_head as trl_lm_head
from ..trainer import ODCTrainerMixin
from ..trainer.budget import BudgetRule
from ..trainer.metrics import StepMetrics
from .loss import dpo_loss_weight
from .metrics import finalize_dpo_metrics
from .reference import ODCReferenceModelMixin, check_reference_settings

logger = logging.getLogger(__name__)

__all__ = ["BATCH_COUPLED_LOSS_TYPES", "PER_PAIR_LOSS_TYPES", "ODCDPOTrainer", "check_dpo_loss_types"]

#: TRL's DPO loss types (``--loss_type``) that are one value per pair, averaged over the microbatch's pairs (WPO's
#: ``use_weighting`` and LD-DPO's ``ld_alpha`` weigh each pair by its own sequences): exact with `dpo_loss_weight`.
PER_PAIR_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
)

#: TRL's DPO loss types whose value for a pair depends on the other pairs of its microbatch, so that no weight makes
#: them exact once the plan regroups the step's pairs -> why (refused under a plan, `check_dpo_loss_types`).
BATCH_COUPLED_LOSS_TYPES = {
    "sft": "averages its NLL over the chosen tokens of each microbatch",
    "aot": (
        "sorts the policy's and the reference's chosen-minus-rejected log-ratios within each microbatch and pairs them "
        "by rank"
    ),
    "aot_unpaired": "sorts the chosen and the rejected log-ratios within each microbatch and pairs them by rank",
}


class ODCDPOTrainer(ODCReferenceModelMixin, ODCTrainerMixin, DPOTrainer):
    """`trl.DPOTrainer` with ODC.

    * **Reference model.** Sharded per layer like the policy (TRL shards only its root, so each reference forward is
      one whole-model all-gather) and, under ODC, served by a gather-only `ODCEngine`: a reference forward reads the
      peers' shards and makes no collective. With ``precompute_ref_log_probs=True`` the reference log-probs are computed
      once before training (TRL's path) and a reference model TRL drops afterwards is released.
    * **Planning.** A pair is one sample of the length-balanced sampler with two batch rows, prompt + chosen and
      prompt + rejected (each truncated to ``max_length``). TRL's collator pads every row of a microbatch to its
      longest sequence, so the plan is made on padded shapes (`odc_accelerate.planning.padded`): pairs of similar lengths share
      a microbatch, which costs ``rows x cost(longest)`` and holds at most the token budget of padded tokens.
    * **Exact loss.** TRL averages the loss over the pairs of each microbatch; here each microbatch's mean is
      reweighted by ``pairs in the microbatch x world size / pairs of the whole step``, so the step's gradient is that
      of the mean over every pair of the global batch, whatever the per-rank split.
    * **Metrics.** TRL's ~15 gathers per microbatch are answered locally and reduced once per step: one value per step
      of loss, rewards/chosen|rejected|accuracies|margins, logps, logits, entropy, token accuracy, plus the ODC
      step metrics (tokens/s, bubble %, per-rank busy/wait).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        training_args = kwargs.get("args")
        if training_args is not None and getattr(training_args, "precompute_ref_log_probs", False):
            for key in ("train_dataset", "eval_dataset"):
                if kwargs.get(key) is not None:
                    kwargs[key] = _shared_on_disk(kwargs[key], training_args, key)
        with (
            trl_dpo.dpo_reference_preparer(self._odc_prepare_reference),
            trl_lm_head.fused_lm_head_torch_path("dpo"),  # TRL 1.15 on CPU
        ):
            super().__init__(*args, **kwargs)
        trl_dpo.check_dpo(self)
        self._odc_release_dropped_reference()

    # ------------------------------------------------------------------ set-up
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # Refuse what ODC cannot do exactly before any model is sharded or any log-prob precomputed.
        args, config = self.args, self.odc_config
        check_reference_settings(args, config)
        check_dpo_loss_types(args, config)

    # ------------------------------------------------------------------ planning
    def _odc_lengths(self, dataset: Any) -> Any:
        from ...planning import dataset_lengths

        prompt = dataset_lengths(dataset, length_column="prompt_ids")
        chosen = prompt + dataset_lengths(dataset, length_column="chosen_ids")
        rejected = prompt + dataset_lengths(dataset, length_column="rejected_ids")
        max_length = getattr(self.args, "max_length", None)
        if max_length:  # the collator truncates each sequence to max_length
            chosen, rejected = np.minimum(chosen, max_length), np.minimum(rejected, max_length)
        return np.stack([chosen, rejected], axis=1)

    def _odc_budget_tokens(self, lengths: Any) -> np.ndarray:
        # TRL's preference collator pads chosen and rejected to the longest sequence of the microbatch: a pair alone
        # holds 2 x its longer sequence.
        return 2 * np.asarray(lengths).max(axis=1)

    def _odc_budget_rule(self, lengths: Any) -> BudgetRule:
        max_length = getattr(self.args, "max_length", None)
        return BudgetRule(
            default=2 * int(max_length) if max_length else int(self._odc_budget_tokens(lengths).max()),
            oversize="raise",
            sample="pair (prompt + chosen and prompt + rejected, both padded to the longer)",
            remedy="lower --max_length",
        )

    # A router's auxiliary loss: each microbatch's term weighted by its share of the step's routed tokens (`moe`);
    # TRL gathers it first.
    _odc_serves_router_aux_loss = True
    _odc_aux_gather_position = 0

    def _odc_num_items(self, microbatches: list[Any]) -> int:
        return sum(int(mb["input_ids"].shape[0]) // 2 for mb in microbatches)  # pairs: [chosen; rejected] rows

    def _odc_queue_items(self, step: Any) -> int:
        # A dynamic step's pairs are its samples: counted from the queue, nothing is collated before the claims.
        return sum(len(mb) for mb in step.queue.microbatches)

    # ------------------------------------------------------------------ loss and metrics
    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):
        if not (self._odc_looping and num_items_in_batch is not None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        pairs = int(inputs["input_ids"].shape[0]) // 2
        weight = dpo_loss_weight(pairs, float(num_items_in_batch), self.accelerator.num_processes)
        # TRL adds coef x aux to the pairs' mean, which the weight then multiplies: the router term's weighted share of
        # the step needs coef x share x W / weight (`moe`).
        with self._odc_router_coef(self.accelerator.num_processes / weight):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if return_outputs:
            return (out[0] * weight, *out[1:])
        return out * weight

    def _odc_finalize_metrics(self, metrics: StepMetrics) -> None:
        expected = len(trl_dpo.dpo_gathers(self))
        if metrics.gathers_per_microbatch != expected:
            logger.warning(
                "ODC: DPO made %d metric gathers per microbatch, expected %d (tested with TRL %s); metrics of this "
                "step are local.",
                metrics.gathers_per_microbatch,
                expected,
                tested_text("trl"),
            )
            return
        finalize_dpo_metrics(self, metrics)


def check_dpo_loss_types(args: Any, config: Any) -> None:
    """Refuse, under a plan, the loss types of `BATCH_COUPLED_LOSS_TYPES` in ``args.loss_type``.

    Raises:
        ValueError: naming the first such loss type, why, and what to change.
    """
    if not config.balanced:
        return
    loss_types = getattr(args, "loss_type", None) or []
    for loss_type in [loss_types] if isinstance(loss_types, str) else list(loss_types):
        why = BATCH_COUPLED_LOSS_TYPES.get(loss_type)
        if why is not None:
            raise ValueError(
                f"loss_type {loss_type!r} {why}, so its value depends on which pairs share a microbatch: that cannot "
                "be made exact when the plan groups the step's pairs into microbatches of its own. Drop "
                f"{loss_type!r} from --loss_type (and its --loss_weights entry), or run without --odc / --odc_plan."
            )


def _shared_on_disk(dataset: Any, args: Any, name: str) -> Any:
    """An in-memory `datasets.Dataset` saved under ``output_dir`` and memory-mapped back, on every rank.

    TRL's ``precompute_ref_log_probs`` has rank 0 write the log-probs next to the dataset's cache files and every rank
    read them back; an in-memory dataset (``Dataset.from_dict``) has no cache files, so each process would look in
    its own temporary folder and the other ranks fail with FileNotFoundError. Datasets loaded from files are returned
    unchanged.
    """
    import os

    from accelerate import PartialState
    from datasets import Dataset, load_from_disk

    from ..._compat import datasets as dcompat

    if not isinstance(dataset, Dataset) or dataset.cache_files or int(getattr(args, "world_size", 1)) <= 1:
        return dataset
    path = os.path.join(args.output_dir, ".odc_datasets", f"{name}-{dcompat.fingerprint(dataset)}")
    state = PartialState()
    with state.main_process_first():
        if state.is_main_process and not os.path.isdir(path):
            dataset.save_to_disk(path)
    return load_from_disk(path)
