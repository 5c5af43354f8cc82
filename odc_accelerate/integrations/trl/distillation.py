"""ODC for TRL's distillation: `ODCDistillationTrainer` (``--odc true`` and friends).

The student generates on-policy on each rank without a collective, and the step's completions are planned over all
ranks (`.online.ODCOnlineTrainerMixin`, as GRPO's); the teacher is sharded per layer and served by a gather-only
engine (`.reference.ODCReferenceModelMixin`); both LM heads are read unsharded from the engine's gathers. See
docs/integrations.md, "TRL distillation".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from trl import DistillationTrainer

from ..._compat import trl as trl_compat
from ..._compat.trl import distillation as trl_distillation
from ...config import ODCConfig
from ..trainer import ODCTrainerMixin
from ..trainer.metrics import StepMetrics
from .metrics import check_gathers, drop_microbatch_values, one_step_time, ratio
from .online import ODCOnlineTrainerMixin
from .reference import ODCReferenceModelMixin
from .rollouts import RolloutKeys

__all__ = ["DISTILLATION_KEYS", "ODCDistillationTrainer", "check_distillation_args", "finalize_distillation_metrics"]

#: DistillationTrainer's generation batch (`odc_accelerate._compat.trl.distillation`): no per-completion value.
DISTILLATION_KEYS = RolloutKeys(
    prompt=tuple(trl_distillation.DISTILLATION_PROMPT_KEYS), token=trl_distillation.DISTILLATION_TOKEN_KEYS, sample=()
)


class ODCDistillationTrainer(ODCOnlineTrainerMixin, ODCReferenceModelMixin, ODCTrainerMixin, DistillationTrainer):
    """`trl.DistillationTrainer` with ODC.

    * **Generation** (on-policy, the student's): each rank decodes its own prompts with ``synced_gpus=False`` over
      ODC's one-sided reads, and stops at its own last token; TRL's per-step gathers of the completion lengths and
      of the loss-token count run once per step, at generation. vLLM is refused under ODC (not tested with it).
    * **Planning** (``--odc_plan free``, the default with ODC, ``lockstep`` or ``dynamic``): one optimizer step is one
      generation batch (``per_device_train_batch_size x gradient_accumulation_steps`` prompts per rank, as in TRL);
      its completions are gathered once and planned over all ranks under the token budget.
    * **Teacher**: sharded per layer like the student (TRL leaves it whole on every rank under FSDP2) and, under ODC,
      served by a gather-only engine: its forward makes no collective.
    * **LM heads**: TRL's loss reads both ``lm_head`` weights directly; each head is unsharded with its final norm's
      FSDP2 group (accelerate's ``[final_norm, lm_head]`` group, gathered by the engine's reads), so TRL's
      ``full_tensor()`` (an all-gather per microbatch) never runs; a head still sharded there is an error.
    * **Exact loss**: TRL divides each microbatch's summed divergence by the step's loss tokens over the world size;
      the ODC plan hands every microbatch the step's global count, so the step's loss is the global per-token mean.
    * **Metrics**: the entropy's two gathers per microbatch are answered locally and reduced once per step.
    """

    odc_trainer_name = "distillation"
    odc_rollout_keys = DISTILLATION_KEYS
    odc_frozen_model_attribute = "teacher_model"

    # ------------------------------------------------------------------ set-up
    def _odc_init_context(self) -> contextlib.AbstractContextManager:
        return trl_distillation.teacher_preparer(self._odc_prepare_reference)

    def _odc_check_trainer(self) -> None:
        trl_distillation.check_distillation(self)

    def _odc_check_settings(self, config: ODCConfig) -> None:
        # Before gradient accumulation is folded, any model sharded or any completion generated.
        check_distillation_args(self.args, config)

    @contextlib.contextmanager
    def _odc_generation_batch(self) -> Iterator[None]:
        """Within the block TRL's loader and sampler see the accumulation the plan folded: their generation batch is
        ``per_device_train_batch_size x gradient_accumulation_steps`` prompts per rank (GRPO names it
        ``steps_per_generation``, which distillation has not)."""
        args, folded = self.args, self.odc_run.folded_accumulation
        if not self.odc_config.balanced or folded == args.gradient_accumulation_steps:
            yield
            return
        current, args.gradient_accumulation_steps = args.gradient_accumulation_steps, folded
        try:
            yield
        finally:
            args.gradient_accumulation_steps = current

    def get_train_dataloader(self) -> Any:
        with self._odc_generation_batch():
            return super().get_train_dataloader()

    def _get_train_sampler(self, dataset: Any = None) -> Any:
        with self._odc_generation_batch():
            return super()._get_train_sampler(dataset)

    # ------------------------------------------------------------------ step
    def _compute_loss(self, unwrapped_student: Any, inputs: Any, num_items_in_batch: Any) -> Any:
        checked = trl_distillation.checked_heads(check_heads_unsharded) if self.odc_config.enable else None
        with checked or contextlib.nullcontext():
            return super()._compute_loss(unwrapped_student, inputs, num_items_in_batch)

    def _odc_loss_weight(self, inputs: dict[str, Any], rows: int) -> float:
        return distillation_loss_weight()

    def _odc_finalize_metrics(self, metrics: StepMetrics) -> None:
        expected = len(trl_distillation.DISTILLATION_TRAIN_GATHERS)
        if check_gathers("distillation", metrics, expected, kept="entropy"):
            finalize_distillation_metrics(self, metrics)


def check_heads_unsharded(*weights: Any) -> None:
    """Raise if an ``lm_head`` weight TRL's loss is about to read is still a sharded DTensor: TRL would all-gather it
    with ``full_tensor()`` in every microbatch, a collective that ranks running different numbers of microbatches do
    not all meet. Checked before that gather, in every rank's first microbatch alike (same models, same wrapping)."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(weight, DTensor) for weight in weights):
        raise RuntimeError(
            "An lm_head weight is still sharded when TRL's distillation loss reads it, so TRL would all-gather it "
            "with full_tensor() in every microbatch, which ODC cannot serve. Shard the LM head in one FSDP2 group "
            "with the final norm (accelerate's fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP does), or run without "
            "--odc."
        )


def distillation_loss_weight() -> float:
    """TRL divides a microbatch's summed divergence by ``num_items_in_batch / world``; under an ODC plan every
    microbatch carries the step's loss tokens over all ranks there, so that FSDP2's mean over ranks makes the step's
    gradient the global per-token mean as it is: weight 1."""
    return 1.0


def finalize_distillation_metrics(trainer: Any, metrics: StepMetrics) -> None:
    """Distillation: the entropy becomes the step's sum of per-token entropies over its loss tokens, over all ranks
    (TRL's value when the global batch is one microbatch); TRL's per-microbatch ``step_time`` becomes the step's."""
    recorded = trl_compat.train_metrics(trainer)
    mbs = metrics.local_microbatches
    tokens, entropy = (
        trl_distillation.DISTILLATION_TRAIN_GATHERS.index(k) for k in ("num_valid_tokens", "entropy_sum")
    )
    drop_microbatch_values(recorded, ("entropy",), mbs)
    recorded["entropy"].append(ratio(metrics.global_sums[entropy], metrics.global_sums[tokens]))
    one_step_time(recorded, mbs)


def check_distillation_args(args: Any, config: ODCConfig) -> None:
    """Refuse, before any work (before any model is sharded or vLLM engine built), the distillation settings ODC
    cannot run.

    Raises:
        ValueError: ``use_vllm=True`` under ODC.
    """
    if config.enable and getattr(args, "use_vllm", False):
        raise ValueError(
            "use_vllm=True is not supported for distillation with ODC (its per-rank vLLM weight sync is tested with "
            "GRPO and RLOO only). Set --use_vllm false (each rank then generates with transformers over ODC's reads, "
            "without collectives), or run without --odc."
        )
