"""ODC for TRL's RLOO: `ODCRLOOTrainer` (``--odc true`` and friends; the arguments are `ODCRLOOConfig`).

RLOO generates like GRPO (`.online.ODCOnlineTrainerMixin`). Its advantages are TRL's, computed over the global generation
batch at generation; each planned microbatch's sequence-level loss is weighted by ``rows x W / completions of the
step`` (`rloo_loss_weight`); entropy and clip ratios are reduced once per step
(`finalize_rloo_metrics`). What it refuses, and why: docs/integrations.md, "TRL RLOO".
"""

from __future__ import annotations

import contextlib
from typing import Any

from trl import RLOOTrainer

from ..._compat import trl as trl_compat
from ..._compat.trl import rloo as trl_rloo
from ...config import ODCConfig
from ...loss import batch_mean_weight
from ..trainer import ODCTrainerMixin
from ..trainer.metrics import StepMetrics
from .metrics import check_gathers, drop_microbatch_values, one_step_time, step_value
from .online import ODCOnlineTrainerMixin
from .online_checks import check_generation_steps, check_no_images, check_vllm_args, check_vllm_sync_settings
from .reference import ODCReferenceModelMixin, check_reference_settings
from .rollouts import RolloutKeys

__all__ = ["RLOO_KEYS", "ODCRLOOTrainer", "check_rloo_args", "finalize_rloo_metrics", "rloo_loss_weight"]

#: RLOOTrainer's generation batch (`odc_accelerate._compat.trl.rloo`).
RLOO_KEYS = RolloutKeys(
    prompt=tuple(trl_rloo.RLOO_PROMPT_KEYS),
    token=trl_rloo.RLOO_TOKEN_KEYS,
    sample=tuple(trl_rloo.RLOO_SAMPLE_KEYS),
)


class ODCRLOOTrainer(ODCOnlineTrainerMixin, ODCReferenceModelMixin, ODCTrainerMixin, RLOOTrainer):
    """`trl.RLOOTrainer` with ODC (see the module docstring).

    * **Generation** makes no collective under ODC (``generate`` without ``synced_gpus``; with ``use_vllm=True`` and
      ``vllm_mode="colocate"`` each rank's engine is refreshed from ODC's shards; with ``vllm_mode="server"`` rank 0
      pushes the weights read from them to the server, `odc_accelerate.integrations.vllm_server`, and TRL gathers the
      prompts once per step); each rank's generation time is
      logged as ``odc/generation_s`` and counts as busy.
    * **Planning** (``--odc_plan free``, the default with ODC, ``lockstep`` or ``dynamic``): one optimizer step trains
      ``per_device_train_batch_size x gradient_accumulation_steps`` completions per rank, as in TRL; a generation
      batch's completions are gathered once, and each step's (a slice of it, once per iteration, with
      ``steps_per_generation`` above the accumulation or ``num_iterations > 1``) are planned over all ranks under the token budget
      (``--odc_max_tokens_per_microbatch``; by default ``per_device_train_batch_size x (longest prompt of the step +
      max_completion_length)``).
    * **Exact loss**: the leave-one-out advantages and the KL-in-reward term are TRL's own, computed over the global
      batch at generation; the sequence-mean loss is rescaled per microbatch.
    * **Reference model** (``beta > 0``, TRL's default 0.05): sharded per layer and, under ODC, served by a
      gather-only engine: a reference forward makes no collective.
    """

    odc_trainer_name = "RLOO"
    odc_rollout_keys = RLOO_KEYS
    odc_trl_module = "trl.trainer.rloo_trainer"

    def _odc_init_context(self) -> contextlib.AbstractContextManager:
        return trl_rloo.rloo_reference_preparer(self._odc_prepare_reference)

    def _odc_check_trainer(self) -> None:
        trl_rloo.check_rloo(self)

    def _odc_check_settings(self, config: ODCConfig) -> None:
        # Before the mixin folds gradient accumulation and before any model is sharded or any completion generated.
        check_rloo_args(self.args, config)
        check_vllm_sync_settings(self.args, self.model, config)
        check_no_images(getattr(self, "_odc_prompts", None), "RLOO", config)

    def _odc_loss_weight(self, inputs: dict[str, Any], rows: int) -> float:
        total_rows, _ = self._odc_totals
        return rloo_loss_weight(rows, total_rows, self.accelerator.num_processes)

    def _odc_finalize_metrics(self, metrics: StepMetrics) -> None:
        expected = len(trl_rloo.rloo_metric_calls(self))
        if check_gathers("RLOO", metrics, expected, what="metric reductions", kept="loss metrics"):
            finalize_rloo_metrics(self, metrics)


def rloo_loss_weight(rows: int, total_rows: int, world_size: int) -> float:
    """RLOO averages its per-sequence loss over the sequences of a microbatch (and TRL divides it by the gradient
    accumulation steps, one under an ODC plan): ``rows x W / sequences of the whole step``."""
    return batch_mean_weight(rows, total_rows, world_size)


def finalize_rloo_metrics(trainer: Any, metrics: StepMetrics) -> None:
    """RLOO: the entropy becomes a ratio of global sums over every completion token of the step; each clip ratio a mean
    (or minimum / maximum) over every completion of the step on every rank; TRL's per-microbatch ``step_time``
    becomes the step's."""
    recorded = trl_compat.train_metrics(trainer)
    mbs = metrics.local_microbatches
    for i, call in enumerate(trl_rloo.rloo_metric_calls(trainer)):
        for name, how in call:
            drop_microbatch_values(recorded, (name,), mbs)
            recorded[name].append(float(step_value(metrics, i, how)))
    one_step_time(recorded, mbs)


def check_rloo_args(args: Any, config: ODCConfig) -> None:
    """Refuse, before any work (and before any vLLM engine is created), the RLOO settings ODC cannot run (exactly).

    The advantages and old log-probs need no refusal: TRL computes them at generation over the gathered generation
    batch, as without a plan (``normalize_advantages`` included).

    Raises:
        ValueError: a tensor-parallel colocated vLLM engine under ODC, ``sync_ref_model`` under ODC, or, under a
            balanced plan, ``steps_per_generation`` not a multiple of ``gradient_accumulation_steps``.
    """
    if config.enable and getattr(args, "use_vllm", False):
        check_vllm_args(args)
    check_reference_settings(args, config)
    if not config.balanced:
        return
    check_generation_steps(args, "run without --odc / --odc_plan (plain FSDP2 with TRL's own microbatches)")
