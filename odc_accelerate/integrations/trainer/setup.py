"""Accelerator set-up of the ODC Trainer: the `ODCPlugin` built from the resolved `ODCConfig`, and the refusals of
launches ODC cannot run on (FSDP1, DDP, a single process).

The Trainer has no argument for a plugin, so ``_build_accelerator_args`` puts an `ODCPlugin` (FSDP2 + ODC engine) in
place of the one accelerate would build from the launch's FSDP settings.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ...config import ODCConfig
from ...planning import PlanName
from ...trainers import SERVED_TRAINERS
from ...validation import str_to_bool
from ..accelerate import ODCPlugin, drive_steps, get_engine, resolved_options
from .moe import check_router_aux_loss, check_transformers_distributed, router_aux_loss_coef
from .run import ODCRun
from .timing import StepTimer

logger = logging.getLogger(__name__)

__all__ = ["ODCAcceleratorSetup", "check_router_aux_loss", "router_aux_loss_coef"]

# How to launch what ODC needs, with what an installed package offers (its presets and config writer).
LAUNCH_HINT = (
    f"Launch with `odc-accelerate {'|'.join(t.name for t in SERVED_TRAINERS)} --accelerate_config odc_cpu|odc_gpu` "
    "(the package's FSDP2 + ODC accelerate configs), or write one with `odc-accelerate config` and run "
    "`odc-accelerate launch --config_file PATH script.py` (the config needs `distributed_type: FSDP`, `fsdp_version: 2` and "
    "num_processes >= 2)."
)


class ODCAcceleratorSetup:
    """Part of `ODCTrainerMixin`: the resolved settings (``odc_config``, read-only), what the run derives from them
    (``odc_run``), the step timer, the accelerator and its ODC engine (``odc_engine``)."""

    def create_accelerator_and_postprocess(self) -> None:
        # The options are resolved once per trainer: a trainer that needed them before the Trainer's own set-up
        # (`_odc_resolve_early`) left them here, and this set-up takes that same object.
        config = self.__dict__.pop("_odc_early_config", None) or ODCConfig.from_sources(args=self.args)
        self.odc_config = config
        check_plan_without_odc(config, int(getattr(self.args, "world_size", 1)))
        self._odc_check_settings(config)
        self.odc_step_timer = StepTimer(
            rank=int(getattr(self.args, "process_index", 0)),
            trace_dir=config.trace_dir,
            time_collectives=config.time_collectives,
        )
        self.odc_run = ODCRun.derive(config, self.args)
        if config.balanced:
            # Ranks may run different numbers of microbatches: the Trainer's accumulation counts them globally, so one
            # dataloader item holds this rank's whole step instead (the effective batch is unchanged; the banner says
            # so, since the Trainer's own banner then shows gradient_accumulation_steps=1).
            self.args.gradient_accumulation_steps = 1
        if not config.enable and self.args.process_index == 0:
            self._odc_warn_if_off(config)
        model = getattr(self, "model", None)
        if config.balanced:
            # Before the accelerator exists: nothing is sharded, no log-prob precomputed, no completion generated.
            check_router_aux_loss(
                model,
                self.args,
                config,
                type(self),
                served=self._odc_router_aux_served(),
                loss=self._odc_plain_loss_owner(),
            )
        if config.enable and model is not None:
            check_transformers_distributed(model)  # every rank loaded the same model: every rank refuses
        with resolved_options(config):
            super().create_accelerator_and_postprocess()
        if config.enable:
            from accelerate.utils import DistributedType

            state = self.accelerator.state
            plugin = getattr(state, "fsdp_plugin", None)
            if state.distributed_type != DistributedType.FSDP or not isinstance(plugin, ODCPlugin):
                raise ValueError(
                    f"ODC needs FSDP2 across several processes, but this run is {state.distributed_type} with "
                    f"{state.num_processes} process(es). {LAUNCH_HINT}"
                )
            # The step loop calls pre_optimizer_step and the callback post_optimizer_step: accelerate's own optimizer
            # step and clipping must not drive the engine as well.
            drive_steps(self.accelerator, False)

    def _odc_resolve_early(self, args: Any) -> ODCConfig:
        """Resolve the options from ``args`` before the Trainer's set-up, for a trainer that needs them then; the
        set-up (`create_accelerator_and_postprocess`) takes this same object instead of resolving again."""
        config = self.__dict__.get("_odc_early_config")
        if config is None:
            config = self._odc_early_config = ODCConfig.from_sources(args=args)
        return config

    def _odc_check_settings(self, config: ODCConfig) -> None:
        """Refuse, right after the options are resolved (before gradient accumulation is folded, any model sharded
        or any completion generated), the trainer's settings ODC cannot run. Nothing here; trainers add theirs."""

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        config = self.odc_config
        if config.enable:
            plugin_args = dict(getattr(self.args, "fsdp_plugin_args", None) or {})
            launched_fsdp = str_to_bool(os.environ.get("ACCELERATE_USE_FSDP", "false"), "ACCELERATE_USE_FSDP")
            if not plugin_args and not launched_fsdp:
                raise ValueError(
                    "ODC needs FSDP2, but this run does not use FSDP (plain DDP or a single process). "
                    f"{LAUNCH_HINT} Or pass `--fsdp full_shard` with `fsdp_version: 2`."
                )
            version = plugin_args.get("fsdp_version") or (
                os.environ.get("FSDP_VERSION", "1") if launched_fsdp and not plugin_args else 2
            )
            if int(version) != 2:
                raise ValueError(
                    f"ODC needs FSDP2, but the FSDP config asks for FSDP{int(version)}. Set `fsdp_version: 2` in the "
                    "accelerate config's fsdp_config (or in --fsdp_config)."
                )
            plugin_args.pop("fsdp_version", None)
            kwargs["fsdp_plugin"] = ODCPlugin(fsdp_version=2, odc_config=config, **plugin_args)
        return super()._build_accelerator_args(**kwargs)

    @property
    def odc_engine(self) -> Any:
        accelerator = getattr(self, "accelerator", None)
        return get_engine(accelerator) if accelerator is not None else None

    # ------------------------------------------------------------------ what the run shows
    def _odc_warn_if_off(self, config: ODCConfig) -> None:
        """Warn when ODC settings were given but ODC is off, so that a run asked for ODC never trains without it
        unnoticed."""
        asked = {name: source for name, source in config.given.items() if name != "enable"}
        env_on = str(os.environ.get("ODC_ENABLE", "")).strip().lower() in ("1", "true", "yes", "on", "y", "t")
        if not asked and not env_on:
            return
        settings = ", ".join(f"odc_{name} ({source})" for name, source in sorted(asked.items()))
        off = f"odc=false from {config.source}" if config.source != "default" else "odc is not set"
        if env_on and config.source != "env":
            settings = ", ".join(filter(None, ["ODC_ENABLE=true (env)", settings]))
        applies = (
            f" Without ODC, plain FSDP2 trains on the {config.plan!r} plan's microbatches." if config.balanced else ""
        )
        logger.warning(
            "ODC is OFF for this run (%s), but ODC settings are present: %s.%s Set --odc true (or `odc: true` in the "
            "accelerate config's fsdp_config, launched with odc-accelerate launch) to train with ODC, or remove them.",
            off,
            settings,
            applies,
        )

    def _odc_banner(self) -> None:
        """Log, once per run on the main process at WARNING, what ODC runs with: transport and why, plan, token
        budget, samples per step and how gradient accumulation was folded into it."""
        config, run = self.odc_config, self.odc_run
        if not config.enable or getattr(self, "_odc_banner_shown", False):
            return
        self._odc_banner_shown = True
        if not self.is_world_process_zero():
            return
        report = self.odc_engine.report()
        world = max(1, int(self.args.world_size))
        ga = run.folded_accumulation
        if self.odc_plans_from_dataset:
            budget = f"{run.max_tokens_per_microbatch} tokens per microbatch"
            samples = (
                f"{run.samples_per_step} samples per optimizer step over {world} ranks "
                f"(per_device_train_batch_size {self.args.per_device_train_batch_size} x gradient_accumulation_steps "
                f"{ga} x {world} ranks"
                + (", set by odc_samples_per_step" if "samples_per_step" in config.given else "")
                + ")"
            )
        else:
            budget = (
                f"{config.max_tokens_per_microbatch} tokens per microbatch"
                if config.max_tokens_per_microbatch
                else "set at each step from its completions (per_device_train_batch_size x (longest prompt + "
                "max_completion_length))"
            )
            samples = f"one generation batch per optimizer step over {world} ranks"
        folded = (
            f"; gradient_accumulation_steps={ga} folded into the plan: the Trainer runs 1 accumulation step and each "
            "rank loops its own microbatches (effective global batch unchanged)"
            if ga != 1
            else ""
        )
        hsdp = (
            f"; HSDP: {report.replicas} replicas x {report.ranks} ranks per shard group, ODC within each shard group "
            f"and {report.replicate_buckets} all-reduce(s) across replicas per optimizer step"
            if report.replicas > 1
            else ""
        )
        memory = f"memory policy {report.memory_policy} (rank 0: {report.memory})"
        if config.memory_policy == "auto":
            memory += f", headroom {config.memory_headroom}, re-chosen by each rank every step"
        # The 'cuda' transport adds gradients with its Triton kernel or, where that cannot run, a slower fallback.
        accumulate = (
            f"; gradients accumulate by {report.accumulate_path} ({report.accumulate_reason})"
            if report.accumulate_path
            else ""
        )
        reduction = f"; gradient reduction {report.reduction} ({report.reduction_reason})"
        logger.warning(
            "ODC on: transport %s (%s%s)%s, plan %s, token budget %s, %s%s; %s%s; metrics %s.",
            report.transport,
            report.transport_reason,
            accumulate,
            hsdp,
            _plan_text(config),
            budget,
            samples,
            folded,
            memory,
            reduction,
            config.metrics,
        )


def check_plan_without_odc(config: ODCConfig, world_size: int) -> None:
    """Refuse, before any work, the ``free`` plan on several ranks with ODC off: it gives ranks different numbers of
    microbatches, which plain FSDP2's per-layer collectives cannot pair (the run would hang at its first unpaired
    collective). ``lockstep`` gives every rank the same count, so plain FSDP2 trains on it."""
    if config.enable or world_size <= 1 or config.effective_plan != PlanName.FREE:
        return
    raise ValueError(
        "odc_plan 'free' needs ODC when several ranks train: it gives ranks different numbers of microbatches, which "
        "plain FSDP2's collectives cannot pair. Turn ODC on (--odc true / odc: true), or, to train plain FSDP2 on "
        "planned microbatches, choose --odc_plan lockstep (or leave odc_plan unset for the Trainer's own batches)."
    )


#: Said in the banner when the dynamic plan runs under the memory policy ``neither``.
DYNAMIC_POLICY_HINT = (
    "under memory policy neither every claimed microbatch gathers the parameters and reduces its gradients again; "
    "odc_memory_policy both (or auto) keeps them through the step where memory allows"
)


def _plan_text(config: ODCConfig) -> str:
    """The banner's words for the plan, with the ``dynamic`` plan's fallback when ``reproducible`` is set."""
    if config.plan == PlanName.DYNAMIC:
        if config.reproducible:
            return "free (odc_plan dynamic with odc_reproducible: the static plan, for run-to-run reproducibility)"
        text = "dynamic (each rank claims the step's next microbatch when it is free)"
        if config.memory_policy == "neither":
            # The queue holds more, smaller microbatches than a static plan, and under "neither" each one gathers the
            # parameters and reduces its gradients again: measured up to 5% slower than the free plan at equal speeds.
            text += f" ({DYNAMIC_POLICY_HINT})"
        return text
    return str(config.plan)
