"""Loss weights that make a TRL loss exact when ranks run different microbatches.

FSDP2 averages gradients over the ``W`` ranks. TRL normalises each microbatch's loss over that microbatch alone (a
mean over its pairs, sequences or tokens); multiplied by the weight below, the step's gradient is that of one process
over the whole global batch, whatever the split of the step over ranks and microbatches.
"""

from __future__ import annotations

from typing import Any

from ..._compat.trl.grpo import GRPO_LOSS_NORMALISATION
from ...loss import batch_mean_weight

__all__ = ["dpo_loss_weight", "grpo_loss_weight", "reward_loss_weight", "rloo_loss_weight"]


def dpo_loss_weight(pairs: int, total_pairs: float, world_size: int) -> float:
    """DPO averages over the pairs of a microbatch: ``pairs x W / pairs of the whole step``."""
    return batch_mean_weight(pairs, total_pairs, world_size)


def reward_loss_weight(pairs: int, total_pairs: float, world_size: int) -> float:
    """The reward-model loss averages over the pairs of a microbatch (``-logsigmoid`` of each pair's reward difference,
    and the ``center_rewards_coefficient`` term, a mean of each pair's squared reward sum): the weight of DPO,
    ``pairs x W / pairs of the whole step``."""
    return dpo_loss_weight(pairs, total_pairs, world_size)


def rloo_loss_weight(rows: int, total_rows: int, world_size: int) -> float:
    """RLOO averages its per-sequence loss over the sequences of a microbatch (and TRL divides it by the gradient
    accumulation steps, one under an ODC plan): ``rows x W / sequences of the whole step``."""
    return batch_mean_weight(rows, total_rows, world_size)


def grpo_loss_weight(
    trainer: Any, rows: int, tokens: float, total_rows: int, total_tokens: float, world_size: int
) -> float:
    """What one microbatch's GRPO loss (as TRL computes it) is multiplied by for the exact loss of the whole step.

    Args:
        trainer: the GRPO trainer (its ``loss_type``, ``current_gradient_accumulation_steps`` and
            ``args.steps_per_generation``).
        rows (`int`): completions in the microbatch.
        tokens (`float`): loss tokens in the microbatch.
        total_rows (`int`): completions in the whole step, over all ranks.
        total_tokens (`float`): loss tokens in the whole step, over all ranks.
        world_size (`int`): ranks FSDP2 averages gradients over.
    """
    kind = GRPO_LOSS_NORMALISATION[trainer.loss_type]
    if kind == "sequences":
        return rows * world_size / max(total_rows, 1)
    if kind == "tokens":
        return max(tokens, 1.0) * world_size / max(total_tokens, 1.0)
    # The "global" types divide by num_items_in_batch (set to the step's loss tokens) the way TRL scales it.
    normaliser = (
        max(total_tokens, 1.0)
        / world_size
        * trainer.current_gradient_accumulation_steps
        / trainer.args.steps_per_generation
    )
    return normaliser * world_size / max(total_tokens, 1.0)
