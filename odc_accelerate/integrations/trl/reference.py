"""The reference model of the DPO, GRPO, RLOO and KTO trainers (and distillation's teacher) under ODC.

TRL prepares its reference model under FSDP2 by sharding the root module only, so each reference forward is one
whole-model all-gather (a collective in every microbatch). Here the reference is sharded per layer like the policy
and, under ODC, served by a gather-only `~odc_accelerate.engine.ODCEngine`: a reference forward reads the peers'
published shards and makes no collective.
"""

from __future__ import annotations

from typing import Any

from ...config import ODCConfig
from ..accelerate import get_frozen_engines, prepare_frozen_model, release_frozen_model

__all__ = ["ODCReferenceModelMixin", "check_reference_settings"]


def check_reference_settings(args: Any, config: ODCConfig) -> None:
    """Refuse, before any model is sharded, reference settings that ODC cannot serve.

    Raises:
        ValueError: ``sync_ref_model=True`` under ODC.
    """
    if config.enable and getattr(args, "sync_ref_model", False):
        raise ValueError(
            "sync_ref_model=True is not supported with ODC: the reference model is served by a gather-only ODC engine "
            "whose published shards would go stale when TRL overwrites the reference weights. Set --sync_ref_model "
            "false, or run without --odc."
        )


class ODCReferenceModelMixin:
    """Prepares a TRL trainer's reference model for ODC (see the module docstring); for trainers with ``ref_model``
    (distillation: ``teacher_model``, named by ``odc_frozen_model_attribute``)."""

    #: The trainer attribute holding the frozen model (DPO, GRPO, RLOO, KTO: the reference; distillation: the teacher).
    odc_frozen_model_attribute = "ref_model"

    def _odc_prepare_reference(self, model: Any, accelerator: Any, trl_prepare: Any) -> Any:
        """Called by TRL's trainer in place of its own ``prepare_fsdp`` (``trl_prepare``, used for FSDP1)."""
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        if plugin is None or int(getattr(plugin, "fsdp_version", 1) or 1) != 2:
            return trl_prepare(model, accelerator)
        return prepare_frozen_model(accelerator, model)

    def _odc_release_dropped_reference(self) -> None:
        """Free what served the reference model once TRL dropped it (after precomputing its log-probs)."""
        if getattr(self, self.odc_frozen_model_attribute, None) is None:
            for engine in get_frozen_engines(self.accelerator):
                release_frozen_model(self.accelerator, engine.model)

    @property
    def odc_reference_engine(self) -> Any:
        """The gather-only `ODCEngine` serving the reference model (distillation: the teacher), or `None`."""
        ref = getattr(self, self.odc_frozen_model_attribute, None)
        accelerator = getattr(self, "accelerator", None)
        if ref is None or accelerator is None:
            return None
        return next((e for e in get_frozen_engines(accelerator) if e.model is ref), None)
