"""`ODCRun`: what an ODC Trainer derives from its resolved options and its training arguments.

The trainer's `~odc_accelerate.config.ODCConfig` (``odc_config``) holds the options as they were resolved and is
read-only. The values the trainer derives from them (how many samples one optimizer step plans, the gradient
accumulation folded into each rank's step, the token budget per microbatch once chosen) are on its ``odc_run``, a
frozen `ODCRun` made at set-up and replaced, never edited, when the loader chooses the budget: every reader (the
banner, the loaders, the step planner, run reports) reads the final value from one place.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from ...config import ODCConfig

__all__ = ["ODCRun"]


@dataclass(frozen=True, kw_only=True)
class ODCRun:
    """The values one ODC Trainer run derives from its `ODCConfig` and training arguments.

    Args:
        samples_per_step (`int`, *optional*):
            Samples of one optimizer step over all ranks, under a plan: ``odc_samples_per_step`` when set, else
            ``per_device_train_batch_size x gradient_accumulation_steps x world size``. `None` without a plan.
        folded_accumulation (`int`, *optional*, defaults to 1):
            The ``gradient_accumulation_steps`` folded into each rank's step under a plan (the Trainer then runs 1
            accumulation step and each rank loops its own microbatches; the effective batch is unchanged).
        max_tokens_per_microbatch (`int`, *optional*):
            The token budget per microbatch the balanced loader chose for the training set
            (``odc_max_tokens_per_microbatch``, else the trainer's default, see `budget.BudgetRule`); `None` until
            then, and for GRPO, which chooses one per step from its completions.
    """

    samples_per_step: int | None = None
    folded_accumulation: int = 1
    max_tokens_per_microbatch: int | None = None

    @classmethod
    def derive(cls, config: ODCConfig, args: Any) -> ODCRun:
        """The run's values at set-up, from the resolved ``config`` and the training arguments ``args`` (read before
        the trainer folds their gradient accumulation)."""
        if not config.balanced:
            return cls()
        world = max(1, int(getattr(args, "world_size", 1)))
        ga = int(args.gradient_accumulation_steps)
        samples = config.samples_per_step
        if samples is None:
            samples = int(args.per_device_train_batch_size) * ga * world
        return cls(samples_per_step=int(samples), folded_accumulation=ga)

    def with_token_budget(self, budget: int) -> ODCRun:
        """This run with the token budget the loader chose."""
        return replace(self, max_tokens_per_microbatch=int(budget))

    def as_dict(self) -> dict[str, Any]:
        """The values as a dict (run reports)."""
        return asdict(self)
