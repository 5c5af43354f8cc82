"""The TRL internals the reward-model trainer reads, checked against the installed version.

TRL's ``RewardTrainer.compute_loss`` gathers per microbatch, in this order (TRL 1.15 and 1.16): the input tokens
(``num_tokens``), every rank's rewards (``min_reward`` / ``mean_reward`` / ``max_reward``), the mean accuracy and the
mean margin, each appended to ``self._metrics["train"]``. The ODC trainer answers them locally and replaces the
recorded values at the step boundary, which needs that order, pinned here. Tested: ``TESTED["trl"]``.
"""

from __future__ import annotations

from typing import Any

from .. import require, warn_if_untested
from . import _LIBRARY

__all__ = ["REWARD_PER_MICROBATCH", "REWARD_TRAIN_GATHERS", "check_reward"]


#: What RewardTrainer.compute_loss passes to accelerator.gather / gather_for_metrics per training microbatch, in call
#: order (see the module docstring).
REWARD_TRAIN_GATHERS = ("num_tokens", "rewards", "accuracy", "margin")

#: Metrics that RewardTrainer appends once per microbatch (the ODC trainer replaces them with one value per step).
#: ``num_tokens`` is not among them: TRL keeps it as a running total (see `odc_accelerate._compat.trl.count_train_tokens`).
REWARD_PER_MICROBATCH = ("min_reward", "mean_reward", "max_reward", "accuracy", "margin")


def check_reward(trainer: Any) -> None:
    """Raise `~odc_accelerate._compat.CompatError` if the reward trainer lacks an attribute the ODC trainer reads or
    rewrites.

    The order of TRL's gathers cannot be checked from outside; on an untested TRL version a warning says so.
    """
    detail = (
        "odc_accelerate reads the reward trainer's metric gathers in the order of the tested versions "
        f"({', '.join(REWARD_TRAIN_GATHERS)}); if TRL changed them, the logged reward metrics may be wrong (the loss "
        "and training are unaffected)."
    )
    warn_if_untested(_LIBRARY, detail)
    for attr in ("_metrics", "_total_train_tokens"):
        require(trainer, attr, library=_LIBRARY, where="trl.RewardTrainer")
