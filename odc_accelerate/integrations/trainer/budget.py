"""The token budget per microbatch: one rule for every ODC trainer.

The budget bounds the tokens of one microbatch (on a GPU, its activation memory). A trainer says how its samples
count against it (`BudgetRule`): the default when none is set, and whether a sample longer than the budget stops the
run before training (nothing would shorten it) or runs alone in an over-budget microbatch with a warning (the sample
is already truncated, or the budget was set on purpose).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["BudgetRule", "token_budget"]


@dataclass(frozen=True, kw_only=True, slots=True)
class BudgetRule:
    """How a trainer's samples count against the token budget per microbatch.

    Args:
        default (`int`): the budget when ``--odc_max_tokens_per_microbatch`` is not set.
        oversize (`str`): ``"raise"``: a sample longer than the budget stops the run before training; ``"warn"``: it
            runs alone in a microbatch over the budget, with a warning.
        sample (`str`): what one sample is, for messages (``"sample"``, ``"pair (prompt + chosen and ...)"``).
        remedy (`str`): what else would fit the samples in the budget, for messages (``"set --max_length"``).
    """

    default: int
    oversize: Literal["raise", "warn"]
    sample: str = "sample"
    remedy: str = "lower --max_length"


def token_budget(tokens: np.ndarray, explicit: int | None, rule: BudgetRule) -> int:
    """The token budget per microbatch for samples of ``tokens`` each.

    Args:
        tokens (`np.ndarray`): each sample's tokens as the budget counts them (one value per sample).
        explicit (`int`, *optional*): the budget the user set.
        rule (`BudgetRule`): the trainer's rule.

    Raises:
        ValueError: a sample is longer than the budget and ``rule.oversize == "raise"``, naming the budget needed.
    """
    budget = int(rule.default if explicit is None else explicit)
    longest = int(np.max(tokens))
    if longest > budget and rule.oversize == "raise":
        raise ValueError(
            f"The ODC token budget per microbatch ({budget}) is smaller than the longest {rule.sample} ({longest} "
            f"tokens). Raise --odc_max_tokens_per_microbatch to at least {longest}, or {rule.remedy}."
        )
    return budget
