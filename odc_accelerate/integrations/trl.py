"""ODC for TRL: `ODCSFTConfig` / `ODCSFTTrainer` and `ODCDPOConfig` / `ODCDPOTrainer` (``--odc true`` and friends).

```python
from odc_accelerate.integrations.trl import ODCSFTConfig, ODCSFTTrainer

args = ODCSFTConfig(output_dir="out", odc=True, odc_max_tokens_per_microbatch=4096)
trainer = ODCSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
trainer.train()
trainer.end()  # closes the ODC engine and destroys the process group
```

The same fields parse from the command line (``--odc true --odc_plan lockstep``) and from a TRL
``--config recipe.yaml``; the same keys in ``--fsdp_config file.json`` work too (see
`odc_accelerate.config.ODCConfig.from_sources`).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, make_dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from .._compat import tested_text
from .._compat import trl as trl_compat
from ..config import ODCConfig, training_args_fields
from .accelerate import enable, get_frozen_engines, prepare_frozen_model, release_frozen_model
from .trainer import ODCTrainerMixin
from .trainer.metrics import StepMetrics

if TYPE_CHECKING:
    from .trl_grpo import ODCGRPOConfig, ODCGRPOTrainer

logger = logging.getLogger(__name__)

__all__ = [
    "ODCDPOConfig",
    "ODCDPOTrainer",
    "ODCGRPOConfig",
    "ODCGRPOTrainer",
    "ODCSFTConfig",
    "ODCSFTTrainer",
    "ODCTrainingArgumentsMixin",
]


def __getattr__(name: str) -> Any:
    # GRPO lives in its own module (it imports TRL's GRPOTrainer, which SFT and DPO runs do not need).
    if name in ("ODCGRPOConfig", "ODCGRPOTrainer"):
        from . import trl_grpo

        return getattr(trl_grpo, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The ODC options as training-argument fields (``--odc``, ``--odc_transport``, ...), generated from `ODCConfig` so that
# each option is defined once. `None` means "not set here": the ``fsdp_config`` keys and ``ODC_*`` environment
# variables are consulted next (see `ODCConfig.from_sources`).
ODCTrainingArgumentsMixin = make_dataclass("ODCTrainingArgumentsMixin", training_args_fields(), kw_only=False)
ODCTrainingArgumentsMixin.__module__ = __name__
ODCTrainingArgumentsMixin.__doc__ = (
    "ODC fields of the ODC training arguments: one per `odc_accelerate.config.ODCConfig` option, named by its key."
)


def _cpu_precision_defaults(args: Any) -> None:
    """On a machine without a bf16-capable GPU, TRL's default ``bf16=True`` would stop the run ("Your setup doesn't
    support bf16/gpu"): the default becomes fp32 there, and an explicit ``--bf16 true`` sets ``use_cpu`` so that bf16
    mixed precision runs on CPU (FSDP2's MixedPrecisionPolicy). GPU runs keep TRL's defaults."""
    if not _gpu_bf16_available():
        if args.bf16 is None and not args.fp16:
            args.bf16 = False
        elif args.bf16:
            args.use_cpu = True


@dataclass
class _ODCTRLConfig(ODCTrainingArgumentsMixin):
    """The ODC fields plus what every ODC TRL config does first: install ODC's accelerate patches (before the training
    arguments create the process group: FSDP2 on CPU needs gloo) and pick CPU precision defaults."""

    def __post_init__(self) -> None:
        enable()
        _cpu_precision_defaults(self)
        super().__post_init__()


@dataclass
class ODCSFTConfig(_ODCTRLConfig, SFTConfig):
    """`trl.SFTConfig` plus the ODC options (``--odc``, ``--odc_plan``, ...; see `odc_accelerate.config.ODCConfig`).

    On a machine without a bf16-capable GPU the precision defaults to fp32, and ``--bf16 true`` runs bf16 mixed
    precision on CPU; GPU runs keep TRL's defaults.
    """


@dataclass
class ODCDPOConfig(_ODCTRLConfig, DPOConfig):
    """`trl.DPOConfig` plus the ODC options (same CPU precision defaults as `ODCSFTConfig`)."""


def _gpu_bf16_available() -> bool:
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    return bool(is_torch_bf16_gpu_available() or is_torch_xla_available())


class ODCSFTTrainer(ODCTrainerMixin, SFTTrainer):
    """`trl.SFTTrainer` with ODC: unequal microbatch counts per rank, exact token-mean loss, no collective inside a
    step (TRL's per-microbatch metric gathers are reduced once per step), per-step ODC metrics in the logs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        with contextlib.ExitStack() as stack:
            stack.enter_context(trl_compat.fused_lm_head_torch_path("sft"))  # TRL 1.15 on CPU
            if (
                training_args is not None
                and getattr(training_args, "padding_free", False)
                and not getattr(training_args, "packing", False)
                and getattr(training_args, "max_length", None) is not None
                and ODCConfig.from_sources(args=training_args).balanced
            ):
                # The balanced plan bounds each padding-free microbatch by its token budget: samples are truncated to
                # max_length as usual (TRL alone refuses padding_free with max_length and no packing).
                stack.enter_context(trl_compat.sft_padding_free_with_max_length(self, training_args))
            super().__init__(*args, **kwargs)
        trl_compat.check_sft(self)

    def _odc_finalize_metrics(self, metrics: StepMetrics) -> None:
        trl_compat.finalize_sft_metrics(self, metrics.local_sums, metrics.global_sums, metrics.local_microbatches)


class ODCDPOTrainer(ODCTrainerMixin, DPOTrainer):
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
            trl_compat.dpo_reference_preparer(self._odc_prepare_reference),
            trl_compat.fused_lm_head_torch_path("dpo"),  # TRL 1.15 on CPU
        ):
            super().__init__(*args, **kwargs)
        trl_compat.check_dpo(self)
        if self.ref_model is None:
            # TRL dropped the reference after precomputing its log-probs: free what served it.
            for engine in get_frozen_engines(self.accelerator):
                release_frozen_model(self.accelerator, engine.model)

    # ------------------------------------------------------------------ set-up
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # Refuse what ODC cannot do exactly before any model is sharded or any log-prob precomputed.
        args, config = self.args, self.odc_config
        if config.enable and getattr(args, "sync_ref_model", False):
            raise ValueError(
                "sync_ref_model=True is not supported with ODC: the reference model is served by a gather-only ODC "
                "engine whose published shards would go stale when TRL overwrites the reference weights. Set "
                "--sync_ref_model false, or run without --odc."
            )
        loss_types = getattr(args, "loss_type", None) or []
        if config.balanced and "sft" in ([loss_types] if isinstance(loss_types, str) else list(loss_types)):
            raise ValueError(
                "loss_type 'sft' averages its NLL over the chosen tokens of each microbatch, which cannot be made exact "
                "when ranks run different microbatches. Drop 'sft' from --loss_type (and its --loss_weights entry), or "
                "run without --odc / --odc_plan."
            )

    def _odc_prepare_reference(self, model: Any, accelerator: Any, trl_prepare: Any) -> Any:
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        if plugin is None or int(getattr(plugin, "fsdp_version", 1) or 1) != 2:
            return trl_prepare(model, accelerator)
        return prepare_frozen_model(accelerator, model)

    @property
    def odc_reference_engine(self) -> Any:
        """The gather-only `ODCEngine` serving the reference model, or `None`."""
        ref = getattr(self, "ref_model", None)
        accelerator = getattr(self, "accelerator", None)
        if ref is None or accelerator is None:
            return None
        return next((e for e in get_frozen_engines(accelerator) if e.model is ref), None)

    # ------------------------------------------------------------------ planning
    def _odc_lengths(self, dataset: Any) -> Any:
        from ..planning import dataset_lengths

        prompt = dataset_lengths(dataset, length_column="prompt_ids")
        chosen = prompt + dataset_lengths(dataset, length_column="chosen_ids")
        rejected = prompt + dataset_lengths(dataset, length_column="rejected_ids")
        max_length = getattr(self.args, "max_length", None)
        if max_length:  # the collator truncates each sequence to max_length
            chosen, rejected = np.minimum(chosen, max_length), np.minimum(rejected, max_length)
        return np.stack([chosen, rejected], axis=1)

    def _odc_budget(self, lengths: Any) -> int:
        # TRL's preference collator pads chosen and rejected to the longest sequence of the microbatch: a pair alone
        # holds 2 x its longer sequence.
        pair_tokens = 2 * np.asarray(lengths).max(axis=1)
        budget = self.odc_config.max_tokens_per_microbatch
        max_length = getattr(self.args, "max_length", None)
        if budget is None:
            budget = 2 * int(max_length) if max_length else int(pair_tokens.max())
        if int(pair_tokens.max()) > budget:
            raise ValueError(
                f"The ODC token budget per microbatch ({budget}) is smaller than the longest pair "
                f"({int(pair_tokens.max())} tokens: prompt + chosen and prompt + rejected, both padded to the longer). "
                f"Raise --odc_max_tokens_per_microbatch to at least {int(pair_tokens.max())}, or lower --max_length."
            )
        return int(budget)

    def _odc_num_items(self, microbatches: list[Any]) -> int:
        return sum(int(mb["input_ids"].shape[0]) // 2 for mb in microbatches)  # pairs: [chosen; rejected] rows

    # ------------------------------------------------------------------ loss and metrics
    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if not (self._odc_looping and num_items_in_batch is not None):
            return out
        pairs = int(inputs["input_ids"].shape[0]) // 2
        weight = pairs * self.accelerator.num_processes / float(num_items_in_batch)
        if return_outputs:
            return (out[0] * weight, *out[1:])
        return out * weight

    def _odc_finalize_metrics(self, metrics: StepMetrics) -> None:
        expected = len(trl_compat.dpo_gathers(self))
        if metrics.gathers_per_microbatch != expected:
            logger.warning(
                "ODC: DPO made %d metric gathers per microbatch, expected %d (tested with TRL %s); metrics of this "
                "step are local.",
                metrics.gathers_per_microbatch,
                expected,
                tested_text("trl"),
            )
            return
        trl_compat.finalize_dpo_metrics(
            self, metrics.local_sums, metrics.global_sums, metrics.global_counts, metrics.local_microbatches
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

    if not isinstance(dataset, Dataset) or dataset.cache_files or int(getattr(args, "world_size", 1)) <= 1:
        return dataset
    path = os.path.join(args.output_dir, ".odc_datasets", f"{name}-{dataset._fingerprint}")
    state = PartialState()
    with state.main_process_first():
        if state.is_main_process and not os.path.isdir(path):
            dataset.save_to_disk(path)
    return load_from_disk(path)
