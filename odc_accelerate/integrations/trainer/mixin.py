"""`ODCTrainerMixin`: runs a `transformers.Trainer` (or TRL trainer) with ODC.

The mixin builds the `ODCPlugin`, makes one dataloader item this rank's whole optimizer step (the Trainer runs with
``gradient_accumulation_steps=1`` and ``training_step`` loops the microbatches), makes the loss exact over the global
batch, answers metric gathers locally and reduces them once per step, logs the ``odc/*`` metrics, and refuses what a
plan cannot serve. What it changes and why: docs/integrations.md, "The transformers `Trainer`: `ODCTrainerMixin`".
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
from .plain import check_token_mean_loss, is_trl_trainer
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
        self._odc_compute_loss_func = kwargs.get("compute_loss_func")  # a plain Trainer's, before the Trainer sets it
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
                served=self._odc_router_aux_served(),
            )
        elif self.odc_config.balanced and not is_trl_trainer(self):
            # A plain Trainer's compute_loss_func passed by position is known only now.
            loss = self._odc_plain_loss_owner()
            check_router_aux_loss(self.model, self.args, self.odc_config, type(self), served=loss is None, loss=loss)
        if self.odc_config.balanced and self.odc_plans_from_dataset:
            check_token_mean_loss(self)  # a plain Trainer's loss that no microbatch weight makes exact
        self.add_callback(ODCCallback(self))
