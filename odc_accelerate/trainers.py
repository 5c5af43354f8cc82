"""The TRL trainers ODC serves and those it refuses, one row each (how to add one: ``docs/extending.md``).

Everything that names trainers reads these rows: the ``odc-accelerate`` commands, the bootstrap's swap of TRL's public
classes, the lazy exports, the refusals and their messages. A leaf: importing it imports nothing of the package.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["REFUSED_TRAINERS", "SERVED_TRAINERS", "RefusedTrainer", "ServedTrainer", "served_list"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ServedTrainer:
    """A TRL trainer ODC serves, and where its parts are.

    Args:
        name (`str`): the ``odc-accelerate NAME`` command, and the name of the trainer's modules: its integration
            ``odc_accelerate.integrations.trl.NAME``, its TRL internals ``odc_accelerate._compat.trl.NAME`` and its
            script ``odc_accelerate.scripts.NAME``.
        trl_config (`str`), trl_trainer (`str`): TRL's public class names (``from trl import ...``); the ODC classes
            are the same names with ``ODC`` in front, defined in `integrations.trl.configs` and the integration module.
        trl_module (`str`): the module where TRL defines the trainer class.
        help (`str`): what the command trains, for ``odc-accelerate --help``.
    """

    name: str
    trl_config: str
    trl_trainer: str
    trl_module: str
    help: str

    @property
    def odc_config(self) -> str:
        return f"ODC{self.trl_config}"

    @property
    def odc_trainer(self) -> str:
        return f"ODC{self.trl_trainer}"

    @property
    def module(self) -> str:
        """The integration module, which defines `odc_trainer`."""
        return f"odc_accelerate.integrations.trl.{self.name}"

    @property
    def script(self) -> str:
        return f"odc_accelerate.scripts.{self.name}"

    @property
    def trl_path(self) -> str:
        """``module.Class`` of TRL's trainer, where TRL defines it."""
        return f"{self.trl_module}.{self.trl_trainer}"


@dataclass(frozen=True, kw_only=True, slots=True)
class RefusedTrainer:
    """A TRL trainer ODC refuses, by its class name (a subclass of it is refused too), and why."""

    trl_trainer: str
    reason: str


SERVED_TRAINERS = (
    ServedTrainer(
        name="sft",
        trl_config="SFTConfig",
        trl_trainer="SFTTrainer",
        trl_module="trl.trainer.sft_trainer",
        help="supervised fine-tuning",
    ),
    ServedTrainer(
        name="dpo",
        trl_config="DPOConfig",
        trl_trainer="DPOTrainer",
        trl_module="trl.trainer.dpo_trainer",
        help="Direct Preference Optimization",
    ),
    ServedTrainer(
        name="grpo",
        trl_config="GRPOConfig",
        trl_trainer="GRPOTrainer",
        trl_module="trl.trainer.grpo_trainer",
        help="Group Relative Policy Optimization",
    ),
    ServedTrainer(
        name="reward",
        trl_config="RewardConfig",
        trl_trainer="RewardTrainer",
        trl_module="trl.trainer.reward_trainer",
        help="reward modelling",
    ),
    ServedTrainer(
        name="rloo",
        trl_config="RLOOConfig",
        trl_trainer="RLOOTrainer",
        trl_module="trl.trainer.rloo_trainer",
        help="REINFORCE Leave-One-Out",
    ),
    ServedTrainer(
        name="kto",
        trl_config="KTOConfig",
        trl_trainer="KTOTrainer",
        trl_module="trl.trainer.kto_trainer",
        help="Kahneman-Tversky Optimization",
    ),
    ServedTrainer(
        name="distillation",
        trl_config="DistillationConfig",
        trl_trainer="DistillationTrainer",
        trl_module="trl.trainer.distillation_trainer",
        help="on-policy knowledge distillation from a teacher model",
    ),
)

_PER_MICROBATCH_MEAN = (
    "its loss is a mean over the microbatch's pairs plus a mean NLL over its chosen tokens, for which ODC has no "
    "weights: under a plan the planned microbatches' means would be summed, so the loss would depend on the plan"
)

REFUSED_TRAINERS = (
    RefusedTrainer(trl_trainer="ORPOTrainer", reason=_PER_MICROBATCH_MEAN),
    RefusedTrainer(trl_trainer="CPOTrainer", reason=_PER_MICROBATCH_MEAN),
    RefusedTrainer(
        trl_trainer="OnlineDPOTrainer",
        reason=(
            "it generates completions inside every training step with gather_object of the prompts (a collective "
            "that ranks running different numbers of microbatches would not meet), and its loss is a mean over the "
            "microbatch's pairs, for which ODC has no weights"
        ),
    ),
)


def served_list(attribute: str, *, quote: str = "", last: str = "and") -> str:
    """The served trainers' ``attribute`` (``"name"``, ``"trl_trainer"``, ...) as a list in a sentence:
    ``served_list("odc_trainer", quote="`")`` is ``"`ODCSFTTrainer`, ... and `ODCRLOOTrainer`"``."""
    names = [f"{quote}{getattr(trainer, attribute)}{quote}" for trainer in SERVED_TRAINERS]
    return ", ".join(names[:-1]) + f" {last} {names[-1]}" if len(names) > 1 else "".join(names)
