"""`ODCTrainerMixin`: runs a `transformers.Trainer` (or TRL trainer) with ODC.

What the mixin changes, and why:

* **Accelerator.** The Trainer has no argument for a plugin, so the mixin builds an `ODCPlugin` (FSDP2 + ODC engine)
  from the resolved `ODCConfig` and the launch's FSDP settings, and refuses FSDP1, DDP or no FSDP with one error.
* **One dataloader item = this rank's whole optimizer step.** A `LengthBalancedBatchSampler` plans every step over
  all ranks (``samples_per_step = per_device_train_batch_size x gradient_accumulation_steps x world_size`` unless set),
  and each rank gets its own list of microbatches, so ranks may run different numbers of microbatches. The
  Trainer's gradient accumulation would count microbatches globally and deadlock, so it runs with
  ``gradient_accumulation_steps=1`` and ``training_step`` loops the microbatches itself; the effective batch is
  unchanged. accelerate's re-sharding of the dataloader is bypassed (the sampler is already rank-aware). With a
  padded collator the plan is made on padded shapes. With ODC the engine's memory policy (``odc_memory_policy``)
  decides whether gradients are scatter-added after every microbatch or once per step; without ODC every microbatch
  but a rank's last runs under ``accelerator.no_sync``, as in the Trainer's own loop.
* **Exact loss.** ``num_items_in_batch`` is the number of label tokens of the whole step over all ranks (one
  all-reduce at the step start, before any microbatch); every microbatch's summed token loss is divided by it and
  multiplied by the world size (the Trainer's ``average_tokens_across_devices`` scaling), which is
  `odc_accelerate.loss_scale`: the loss equals one process's per-token mean over the global batch.
* **No collective inside a step.** ``accelerator.gather_for_metrics`` calls made during the microbatches (TRL makes
  several per microbatch) are answered locally and recorded; one all-reduce at the step boundary produces the global
  values (see `metrics.reduce_step_metrics` and `ODCTrainerMixin._odc_finalize_metrics`).
* **Step boundary.** ``engine.pre_optimizer_step()`` runs at the end of ``training_step``, so the Trainer's grad-norm
  and clipping see the final gradients; `ODCCallback.on_optimizer_step` calls ``engine.post_optimizer_step()``.
* **Metrics** (logged with the loss, so they land in ``trainer_state.json``'s ``log_history``; ``odc_metrics``):
  ``odc/tokens_per_s`` (non-padding input tokens of all ranks per second of wall time), ``odc/step_s``,
  ``odc/microbatches_min|max``, ``odc/bubble_pct``, and the minimum, maximum and mean over ranks of busy (a rank's own
  forward and backward) and wait (the rest of the step: barriers, metric reductions, collectives, the optimizer);
  each rank's own with ``odc_metrics=per_rank`` (see `timing.StepTimer`). Plain FSDP2 runs through this mixin log the
  same keys when asked, measured the same way; ``odc_time_collectives`` makes FSDP2's waits inside its per-layer
  collectives count as wait instead of busy.
* **Dynamic plan** (``odc_plan: dynamic``). Every rank's item is the step's queue of microbatches; each rank claims
  the next one when it is free and loads and collates only what it claims (see `dynamic`).
* **Streams.** A training set without length or indexing (``--dataset_streaming true``) is planned one step at a
  time: every rank reads the whole stream and keeps its own microbatches (`~odc_accelerate.planning.StreamingStepPlanner`).
* **A plain Trainer's per-batch-mean loss** (a script's ``compute_loss`` the Trainer divides by the accumulation
  steps) is weighted by ``rows x W / rows of the step``: the mean over the step's rows (`plain`, `step`).
* **Refused under a plan:** the plain Trainer's own loss where it would be a mean per microbatch,
  ``average_tokens_across_devices=False`` with a loss normalised by ``num_items_in_batch`` (the plain Trainer's and
  SFT's), collators that cannot collate samples of different lengths together, and a ``get_train_dataloader`` that
  does not return ODC's step loader (`plain`); a mixture-of-experts router's auxiliary loss (TRL's
  ``router_aux_loss_coef``, on by default for such models) in a trainer that does not weight it (`moe`).
* **A router's auxiliary loss** (SFT, DPO): each microbatch's term weighted by its share of the step's routed tokens
  over all ranks (`moe`), its coefficient scaled per microbatch (`ODCStepLoop._odc_router_coef`); logged as
  ``aux_loss``, the step's weighted value.
* **transformers' own distribution** (``distributed_config``: expert, tensor or FSDP parallelism) is refused with
  ODC on (`moe.check_transformers_distributed`).
* **Trainers served.** ``transformers.Trainer`` and TRL's SFT, DPO, GRPO, RLOO and reward trainers through the ODC
  classes (and subclasses of them); the mixin on any other TRL trainer (KTO, ORPO, CPO, online DPO, ...) is refused by
  name at construction (`odc_accelerate.integrations.trl.unsupported.check_mixin_trainer`).
* **Checkpoints.** After the Trainer loads weights, ``engine.republish()`` makes peers read the loaded shards. The
  sampler is deterministic (seed, epoch, step) and a stream is read in its own order, so skipping the trained steps
  resumes the exact data order.
"""

from __future__ import annotations

from typing import Any

from ..._compat import datasets as dcompat
from ..._compat import transformers as tcompat
from ..accelerate import enable
from ..trl.unsupported import check_mixin_trainer
from .callback import ODCCallback
from .loaders import ODCStepLoaders
from .moe import check_router_aux_loss
from .plain import check_token_mean_loss
from .resume import ODCResume
from .setup import ODCAcceleratorSetup
from .step import ODCStepLoop
from .streaming import ODCStreamLoaders

__all__ = ["ODCTrainerMixin"]


class ODCTrainerMixin(ODCAcceleratorSetup, ODCStepLoaders, ODCStreamLoaders, ODCStepLoop, ODCResume):
    """Mixin that runs a `transformers.Trainer` (or TRL trainer) with ODC; put it first in the bases.

    ODC settings come from the training arguments' ``odc`` / ``odc_*`` fields (see
    `odc_accelerate.integrations.trl.ODCSFTConfig`), the ODC keys of ``fsdp_config``, or ``ODC_*`` environment
    variables, in that order (see `ODCConfig.from_sources`). The launch must be FSDP2 (an accelerate config with
    ``distributed_type: FSDP`` and ``fsdp_version: 2``); on CPU it runs with gloo and shared memory.

    Attributes:
        odc_config (`ODCConfig`): the settings, resolved once per trainer and read-only.
        odc_run (`ODCRun`): what the run derives from them: samples per step, the folded gradient accumulation, the
            token budget per microbatch once the loader chose it.
        odc_engine (`ODCEngine` or `None`): the engine, once the model is prepared.
        odc_step_timer (`StepTimer`): per-step timing behind the ``odc/*`` metrics.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Every rank, any launch, before any work: a TRL trainer ODC does not serve, by name.
        check_mixin_trainer(type(self), ODCTrainerMixin)
        enable()
        tcompat.check()
        dcompat.check()
        tcompat.passthrough_skip_first_batches()
        self._odc_sampler = None
        self._odc_looping = False  # inside the balanced step's microbatch loop (loss scaling of subclasses)
        self._odc_step_rows = 0  # rows (samples) of the current step over all ranks (per-batch-mean loss weights)
        self._odc_step_routed = 0  # routed tokens of the current step over all ranks (a router's auxiliary loss)
        self._odc_aux_share = None  # the current microbatch's share of them, while its loss is computed
        self._odc_budget_warned = False  # the over-budget warning is given once per trainer
        self._odc_dynamic_dataset, self._odc_dynamic_rows = None, False  # where a dynamic step's claims load from
        self.odc_dynamic_loads = [0, 0.0]  # dynamic plan: microbatches fetched and collated, and the seconds it took
        super().__init__(*args, **kwargs)
        if self.odc_config.balanced and getattr(self, "aux_loss_enabled", False):
            # TRL's own decision, should it differ from the one `create_accelerator_and_postprocess` checked from
            # the model's config and the arguments (then nothing has trained yet either).
            check_router_aux_loss(
                self.model,
                self.args,
                self.odc_config,
                type(self),
                coef=getattr(self, "router_aux_loss_coef", None),
                served=self._odc_serves_router_aux_loss,
            )
        if self.odc_config.balanced and self.odc_plans_from_dataset:
            check_token_mean_loss(self)  # a plain Trainer's loss that no microbatch weight makes exact
        self.add_callback(ODCCallback(self))
