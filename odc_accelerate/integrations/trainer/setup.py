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
from ...validation import str_to_bool
from ..accelerate import ODCPlugin, get_engine
from .metrics import StepTimer

logger = logging.getLogger(__name__)

__all__ = ["ODCAcceleratorSetup"]


class ODCAcceleratorSetup:
    """Part of `ODCTrainerMixin`: the resolved settings (``odc_config``), the step timer, the accelerator and its
    ODC engine (``odc_engine``)."""

    def create_accelerator_and_postprocess(self) -> None:
        self.odc_config = ODCConfig.from_sources(args=self.args)
        config = self.odc_config
        self.odc_step_timer = StepTimer(
            rank=int(getattr(self.args, "process_index", 0)),
            trace_dir=config.trace_dir,
            time_collectives=config.time_collectives,
        )
        if config.balanced:
            world = max(1, int(getattr(self.args, "world_size", 1)))
            ga = int(self.args.gradient_accumulation_steps)
            if config.samples_per_step is None:
                config.samples_per_step = int(self.args.per_device_train_batch_size) * ga * world
            if ga != 1:
                # Ranks may run different numbers of microbatches: the Trainer's accumulation counts them globally,
                # so one dataloader item holds this rank's whole step instead (the effective batch is unchanged).
                logger.info(
                    "ODC: gradient_accumulation_steps=%d folded into samples_per_step=%d; the Trainer runs 1 "
                    "accumulation step per optimizer step.",
                    ga,
                    config.samples_per_step,
                )
                self.args.gradient_accumulation_steps = 1
        super().create_accelerator_and_postprocess()
        if config.enable:
            from accelerate.utils import DistributedType

            state = self.accelerator.state
            plugin = getattr(state, "fsdp_plugin", None)
            if state.distributed_type != DistributedType.FSDP or not isinstance(plugin, ODCPlugin):
                raise ValueError(
                    f"ODC needs FSDP2 across several processes, but this run is {state.distributed_type} with "
                    f"{state.num_processes} process(es). Launch with `accelerate launch --config_file <cfg>` where the "
                    "config has `distributed_type: FSDP`, `fsdp_version: 2` and num_processes >= 2."
                )

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        config = self.odc_config
        if config.enable:
            plugin_args = dict(getattr(self.args, "fsdp_plugin_args", None) or {})
            launched_fsdp = str_to_bool(os.environ.get("ACCELERATE_USE_FSDP", "false"), "ACCELERATE_USE_FSDP")
            if not plugin_args and not launched_fsdp:
                raise ValueError(
                    "ODC needs FSDP2, but this run does not use FSDP (plain DDP or a single process). Launch with an "
                    "accelerate config that has `distributed_type: FSDP` and `fsdp_version: 2` (e.g. "
                    "examples/sft/configs/odc_cpu.yaml), or pass `--fsdp full_shard` with `fsdp_version: 2`."
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
            kwargs["fsdp_plugin"] = ODCPlugin(fsdp_version=2, **config.options(), **plugin_args)
        return super()._build_accelerator_args(**kwargs)

    @property
    def odc_engine(self) -> Any:
        accelerator = getattr(self, "accelerator", None)
        return get_engine(accelerator) if accelerator is not None else None
