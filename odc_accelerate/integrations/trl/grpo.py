"""ODC for TRL's GRPO: `ODCGRPOConfig` / `ODCGRPOTrainer` (``--odc true`` and friends).

Generation makes no collective (`.online.ODCOnlineTrainerMixin`: each rank decodes its own prompts, or refreshes its
own colocated vLLM engine from the published shards); the step's completions are planned over all ranks like SFT
samples (``--odc_plan free`` unless ``lockstep`` or ``dynamic``), and each microbatch's loss is weighted for its loss
type (`grpo_loss_weight`). See docs/integrations.md, "TRL GRPO".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from trl import GRPOTrainer

from ..._compat import trl as trl_compat
from ..._compat.trl import grpo as trl_grpo
from ..._compat.trl import lm_head as trl_lm_head
from ...config import ODCConfig
from ..trainer import ODCTrainerMixin
from ..trainer.metrics import StepMetrics
from .metrics import check_gathers, drop_microbatch_values, one_step_time, step_value
from .online import ODCOnlineTrainerMixin
from .online_checks import check_grpo_args, check_grpo_settings, check_no_images
from .reference import ODCReferenceModelMixin
from .rollouts import GRPO_KEYS, loss_tokens

__all__ = ["ODCGRPOTrainer", "check_grpo_args", "finalize_grpo_metrics", "grpo_loss_weight"]


class ODCGRPOTrainer(ODCOnlineTrainerMixin, ODCReferenceModelMixin, ODCTrainerMixin, GRPOTrainer):
    """`trl.GRPOTrainer` with ODC. Generation and the planned step are `.online.ODCOnlineTrainerMixin`'s (shared with
    RLOO); what is GRPO's own here: its reference preparer and TRL checks, its refusals, its exact loss weight per loss
    type, the importance-sampling keys of vLLM's ``sequence_*`` modes and its step metrics.

    * **Generation** makes no collective under ODC: ``generate`` runs with ``synced_gpus=False`` on every rank, so a
      rank stops decoding at its own last token. Plain FSDP2 runs keep transformers' choice (TRL's behaviour). Each
      rank's time inside ``generate`` is logged as ``odc/generation_s_rank<r>``, and counts as busy.
    * **vLLM** (``use_vllm=True``, ``vllm_mode="colocate"``) under ODC: each rank owns one engine (TRL creates it,
      ``vllm_tensor_parallel_size=1``). Where TRL syncs its weights, this rank's engine is refreshed from ODC's
      published shards instead (`odc_accelerate.integrations.vllm.sync_vllm_weights`: transport reads, no
      collective), then generates this rank's prompts; the sync and vLLM's ``generate`` count as generation time.
      TRL's importance-sampling correction on vLLM's log-probs is re-batched per completion with the plan. The engine
      is shut down, keeping the job's process group, when the run ends. With PEFT, the engine gets the merged
      weights (as TRL syncs them). Tensor-parallel colocated engines are refused under ODC.
    * **vLLM server mode** (``vllm_mode="server"``) under ODC: rank 0 alone reads the full weights from the
      published shards and pushes them to the server (`odc_accelerate.integrations.vllm_server`: TRL's NCCL client on
      CUDA, safetensors files the server reloads elsewhere); the other ranks take no part in the sync. Generation is
      TRL's: the prompts gathered to rank 0, the completions broadcast, once per generation batch.
    * **Planning** (``--odc_plan free``, the default with ODC, or ``lockstep``): one optimizer step trains
      ``per_device_train_batch_size x gradient_accumulation_steps`` completions per rank, as in TRL (the whole
      generation batch unless ``steps_per_generation`` is larger). A generation batch's completions are gathered once
      and each step's are planned over all ranks under the token budget
      (``--odc_max_tokens_per_microbatch``; by default ``per_device_train_batch_size x (longest prompt of the step +
      max_completion_length)``, the largest microbatch TRL itself would run), and each rank trains its own share.
    * **Exact loss** for every loss type of TRL (grpo, bnpo, dr_grpo, dapo, luspo, sapo, cispo, vespo): each
      microbatch's loss is rescaled so that the step's gradient equals one process's over the whole global batch.
      What cannot be made exact is refused under a plan: the entropy bonus and the top-entropy mask (per-microbatch
      statistics), several generation batches per optimizer step, prompts with images (refused by name at set-up).
      A MoE router's auxiliary loss is weighted by each microbatch's share of the step's routed tokens
      (`odc_accelerate.integrations.trainer.moe`).
    * **Several updates per generation batch** (``num_iterations > 1``, ``steps_per_generation`` a multiple of
      ``gradient_accumulation_steps``): each optimizer step the generation batch feeds is planned from its slice of the
      gathered completions, as TRL slices them, and replayed for each iteration, with TRL's old log-probs (a
      no-gradient pass of the model before any update, once per generation batch).
    * **Reference model** (``beta > 0``): sharded per layer and, under ODC, served by a gather-only engine: a reference
      forward makes no collective.
    * **Metrics**: TRL's per-microbatch reductions (kl, entropy, clip ratios) are answered locally and reduced once per
      step, plus the ODC step metrics (tokens/s, per-rank busy / wait / generation time).
    """

    odc_trainer_name = "GRPO"
    odc_rollout_keys = GRPO_KEYS

    # ------------------------------------------------------------------ set-up
    @contextlib.contextmanager
    def _odc_init_context(self) -> Iterator[None]:
        with (
            trl_grpo.grpo_reference_preparer(self._odc_prepare_reference),
            trl_lm_head.fused_lm_head_torch_path("grpo"),  # a no-op on the TRL releases GRPO is tested with
        ):
            yield

    def _odc_check_trainer(self) -> None:
        trl_grpo.check_grpo(self)

    def _odc_check_settings(self, config: ODCConfig) -> None:
        # Before the mixin folds gradient accumulation and before any model is sharded or any completion generated.
        check_grpo_settings(self.args, self.model, config)
        check_no_images(getattr(self, "_odc_prompts", None), "GRPO", config)

    # ------------------------------------------------------------------ step
    def _odc_sequence_keys(self) -> tuple[str, ...]:
        """The keys of a generation batch with one value per completion rather than per token, by TRL's settings: the
        importance-sampling ratio in vLLM's ``sequence_*`` correction modes."""
        if (
            getattr(self, "use_vllm", False)
            and getattr(self, "vllm_importance_sampling_correction", False)
            and getattr(self, "vllm_importance_sampling_mode", None) in trl_grpo.GRPO_SEQUENCE_IS_MODES
        ):
            return tuple(trl_grpo.GRPO_TOKEN_OR_SEQUENCE_KEYS)
        return ()

    def _odc_loss_weight(self, inputs: dict[str, Any], rows: int) -> float:
        total_rows, total_tokens = self._odc_totals
        return grpo_loss_weight(
            self,
            rows=rows,
            tokens=float(loss_tokens(inputs).sum()),
            total_rows=total_rows,
            total_tokens=total_tokens,
            world_size=self.accelerator.num_processes,
        )

    def _odc_aux_divisor(self) -> float:
        return float(self.current_gradient_accumulation_steps)  # TRL scales the router's term as its policy loss

    def _odc_finalize_metrics(self, metrics: StepMetrics) -> None:
        expected = len(trl_grpo.grpo_metric_calls(self))
        if check_gathers("GRPO", metrics, expected, what="metric reductions", kept="loss metrics"):
            finalize_grpo_metrics(self, metrics)


def grpo_loss_weight(
    trainer: Any, rows: int, tokens: float, total_rows: int, total_tokens: float, world_size: int
) -> float:
    """What one microbatch's GRPO loss (as TRL computes it) is multiplied by for the exact loss of the whole step.

    Args:
        trainer: the GRPO trainer (its ``loss_type``, ``current_gradient_accumulation_steps`` and the accumulation
            it folded, ``odc_run.folded_accumulation``).
        rows (`int`): completions in the microbatch.
        tokens (`float`): loss tokens in the microbatch.
        total_rows (`int`): completions in the whole step, over all ranks.
        total_tokens (`float`): loss tokens in the whole step, over all ranks.
        world_size (`int`): ranks FSDP2 averages gradients over.
    """
    kind = trl_grpo.GRPO_LOSS_NORMALISATION[trainer.loss_type]
    if kind == "sequences":
        return rows * world_size / max(total_rows, 1)
    if kind == "tokens":
        return max(tokens, 1.0) * world_size / max(total_tokens, 1.0)
    # The "global" types divide a microbatch's token sum by num_items_in_batch (the generation batch's loss tokens,
    # over all ranks) / world x gradient_accumulation_steps / steps_per_generation: TRL's step is the sum over its
    # tokens / (those tokens x ga / spg). The ODC microbatch runs with the accumulation folded
    # (current_gradient_accumulation_steps, 1), so it undoes that and divides by TRL's own accumulation instead.
    return trainer.current_gradient_accumulation_steps / trainer.odc_run.folded_accumulation


def finalize_grpo_metrics(trainer: Any, metrics: StepMetrics) -> None:
    """GRPO: each loss metric (kl, entropy, clip ratios, ...) becomes one global value (a ratio of summed pairs, a
    minimum or a maximum over every rank); TRL's per-microbatch ``step_time`` becomes the step's."""
    recorded = trl_compat.train_metrics(trainer)
    mbs = metrics.local_microbatches
    for i, (name, how) in enumerate(trl_grpo.grpo_metric_calls(trainer)):
        drop_microbatch_values(recorded, (name,), mbs)
        recorded[name].append(float(step_value(metrics, i, how)))
    one_step_time(recorded, mbs)
