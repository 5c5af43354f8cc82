"""`ODCDPOTrainer`: TRL's `DPOTrainer` with ODC."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import numpy as np
from trl import DPOTrainer

from ..._compat import trl as trl_compat
from ..._compat.trl import dpo as trl_dpo
from ..._compat.trl import lm_head as trl_lm_head
from ..trainer import ODCTrainerMixin
from ..trainer.metrics import StepMetrics
from .metrics import check_gathers, drop_microbatch_values, ratio
from .packing import PackedPairs, packed_forward, padded_view, pair_packing_obstacle
from .pairs import ODCPairTrainerMixin, pair_lengths
from .reference import ODCReferenceModelMixin, check_reference_settings

logger = logging.getLogger(__name__)

__all__ = [
    "BATCH_COUPLED_LOSS_TYPES",
    "PER_PAIR_LOSS_TYPES",
    "ODCDPOTrainer",
    "check_dpo_loss_types",
    "finalize_dpo_metrics",
]

#: TRL's DPO loss types (``--loss_type``) that are one value per pair, averaged over the microbatch's pairs (WPO's
#: ``use_weighting`` and LD-DPO's ``ld_alpha`` weigh each pair by its own sequences): exact with the pair weight
#: (`.pairs.pair_loss_weight`).
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


class ODCDPOTrainer(ODCReferenceModelMixin, ODCPairTrainerMixin, ODCTrainerMixin, DPOTrainer):
    """`trl.DPOTrainer` with ODC.

    * **Reference model.** Sharded per layer like the policy (TRL shards only its root, so each reference forward is
      one whole-model all-gather) and, under ODC, served by a gather-only `ODCEngine`: a reference forward reads the
      peers' shards and makes no collective. With ``precompute_ref_log_probs=True`` the reference log-probs are computed
      once before training (TRL's path) and a reference model TRL drops afterwards is released.
    * **Planning.** A pair is one sample of the length-balanced sampler with two batch rows, prompt + chosen and
      prompt + rejected (each truncated to ``max_length``). TRL's collator pads every row of a microbatch to its
      longest sequence, so the plan is made on padded shapes (`odc_accelerate.planning.padded`): pairs of similar lengths share
      a microbatch, which costs ``rows x cost(longest)`` and holds at most the token budget of padded tokens.
    * **Without padding** (``padding_free=True``, which TRL 1.16's own trainer turns off): each microbatch's pairs are
      packed into one row, chosen and rejected each its own sequence (`.packing`), and the plan counts their real
      tokens. Where packing cannot keep the sequences apart (`.packing.pair_packing_obstacle`: another attention
      implementation, recurrent layers without their kernels, images, prompt-learning PEFT) the pairs are padded, with
      a warning saying why.
    * **Exact loss.** TRL averages the loss over the pairs of each microbatch; here each microbatch's mean is
      reweighted by ``pairs in the microbatch x world size / pairs of the whole step``, so the step's gradient is that
      of the mean over every pair of the global batch, whatever the per-rank split.
    * **Metrics.** TRL's ~15 gathers per microbatch are answered locally and reduced once per step: one value per step
      of loss, rewards/chosen|rejected|accuracies|margins, logps, logits, entropy, token accuracy, plus the ODC
      step metrics (tokens/s, bubble %, per-rank busy/wait).
    """

    odc_pair_sample = "pair (prompt + chosen and prompt + rejected, both padded to the longer)"
    #: The forwards (policy and reference) that ran packed so far (``odc_packs_pairs``: ``padding_free=True`` and
    #: nothing in the way).
    odc_packed_forwards = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        training_args = kwargs.get("args")
        if training_args is not None and getattr(training_args, "precompute_ref_log_probs", False):
            for key in ("train_dataset", "eval_dataset"):
                if kwargs.get(key) is not None:
                    kwargs[key] = _shared_on_disk(kwargs[key], training_args, key)
        padding_free = bool(getattr(training_args, "padding_free", False))
        with (
            trl_dpo.dpo_reference_preparer(self._odc_prepare_reference),
            trl_lm_head.fused_lm_head_torch_path("dpo"),  # TRL 1.15 on CPU
            trl_dpo.padding_free_warning_silenced() if padding_free else contextlib.nullcontext(),
        ):
            super().__init__(*args, **kwargs)
        trl_dpo.check_dpo(self)
        self._odc_release_dropped_reference()
        if padding_free:
            self._odc_choose_packing()

    def _odc_choose_packing(self) -> None:
        """Pack the pairs (``padding_free=True``) unless `pair_packing_obstacle` says why not; then warn and pad."""
        obstacle = pair_packing_obstacle(self)
        if obstacle is None:
            self.odc_packs_pairs = True
            self.odc_pair_sample = "pair (prompt + chosen and prompt + rejected, packed into one row)"
        elif self.is_world_process_zero():
            logger.warning(
                "padding_free=True: ODC trains these DPO pairs padded, one row per sequence, because %s.", obstacle
            )

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
        return pair_lengths(chosen, rejected)

    def _odc_padded(self) -> bool:
        return not self.odc_packs_pairs and super()._odc_padded()

    def _odc_collator(self) -> Any:
        collator = super()._odc_collator()
        if not self.odc_packs_pairs:
            return collator
        cached = self.__dict__.get("_odc_packed_collator")
        if cached is None or cached.collator is not collator:
            cached = self._odc_packed_collator = PackedPairs(collator)
        return cached

    @contextlib.contextmanager
    def _odc_packed_forward(self, model: Any) -> Any:
        """Where the pairs are packed, the policy's and the reference's forwards run packed (`packed_forward`)."""
        if not self.odc_packs_pairs:
            yield
            return
        from ...hybrid import recurrent_model

        modules = (model, self.model, getattr(self, "ref_model", None))
        with packed_forward(modules, boundaries=recurrent_model(self.model)) as ran:
            try:
                yield
            finally:
                self.odc_packed_forwards += len(ran)

    # A router's auxiliary loss: each microbatch's term weighted by its share of the step's routed tokens (`moe`);
    # TRL gathers it first.
    _odc_serves_router_aux_loss = True
    _odc_aux_gather_position = 0

    # ------------------------------------------------------------------ loss and metrics
    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):
        # TRL's loss reads padded rows: a packed microbatch is handed to it as its padded view, and its forwards are
        # packed again (`.packing`).
        inputs = padded_view(inputs) if self.odc_packs_pairs else inputs
        if not (self._odc_looping and num_items_in_batch is not None):
            with self._odc_packed_forward(model):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        weight = self._odc_pair_weight(inputs, num_items_in_batch)
        # TRL adds coef x aux to the pairs' mean, which the weight then multiplies: the router term's weighted share of
        # the step needs coef x share x W / weight (`moe`).
        with self._odc_router_coef(self.accelerator.num_processes / weight), self._odc_packed_forward(model):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if return_outputs:
            return (out[0] * weight, *out[1:])
        return out * weight

    def _odc_finalize_metrics(self, metrics: StepMetrics) -> None:
        if check_gathers("DPO", metrics, len(trl_dpo.dpo_gathers(self))):
            finalize_dpo_metrics(self, metrics)


def finalize_dpo_metrics(trainer: Any, metrics: StepMetrics) -> None:
    """DPO: token-weighted metrics (entropy, logits, token accuracy) are ratios of global sums; reward and log-prob
    metrics are means over every pair of the step on every rank; ``num_tokens`` counts the input tokens of all
    ranks."""
    names = trl_dpo.dpo_gathers(trainer)
    total = dict(zip(names, metrics.global_sums, strict=False))
    count = dict(zip(names, metrics.global_counts, strict=False))
    mine = dict(zip(names, metrics.local_sums, strict=False))
    recorded = trl_compat.train_metrics(trainer)
    drop_microbatch_values(recorded, trl_dpo.DPO_PER_MICROBATCH, metrics.local_microbatches)
    values = {
        "entropy": ratio(total["entropy_sum"], total["entropy_tokens"]),
        "logits/chosen": ratio(total["chosen_logits_sum"], total["chosen_tokens"]),
        "logits/rejected": ratio(total["rejected_logits_sum"], total["rejected_tokens"]),
        "mean_token_accuracy": ratio(total["correct_tokens"], total["accuracy_tokens"]),
    }
    per_pair = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"]
    per_pair += ["logps/chosen", "logps/rejected"]
    for key in per_pair:
        values[key] = ratio(total[key], count[key])
    if "aux_loss" in names:  # weighted by each microbatch's share of the step's routed tokens: their sum
        values["aux_loss"] = total["aux_loss"]
    for key, value in values.items():
        recorded[key].append(value)
    trl_compat.count_train_tokens(trainer, total["num_tokens"], mine["num_tokens"])


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
