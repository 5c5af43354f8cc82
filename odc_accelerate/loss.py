"""Loss scaling for unequal work per rank.

FSDP2 (and ODC) average gradients over ranks, ``grad = (1/W) sum_r g_r``, so a per-token loss is exact over the step
when each microbatch's loss is its summed token loss times ``W / N`` (``N``: label tokens of the whole step on all
ranks, known from the plan or one all-reduce at step start): every token then weighs ``1/N``, whichever rank or
microbatch ran it. A per-microbatch mean would weight a token by ``1 / (tokens of its microbatch)``. See
docs/design.md, "What the engine guarantees".
"""

from __future__ import annotations


def loss_scale(global_num_tokens: int, world_size: int) -> float:
    """Factor that turns a microbatch's summed per-token loss into the loss to ``backward()`` under ODC/FSDP2.

    Args:
        global_num_tokens (`int`): label tokens in the whole optimizer step, over all ranks and microbatches.
        world_size (`int`): number of data-parallel ranks FSDP2 averages over.

    Returns:
        `float`: ``world_size / global_num_tokens``; use ``(token_losses.sum() * scale).backward()``.

    Example:

    ```python
    scale = loss_scale(total_label_tokens_of_step, dist.get_world_size())
    for mb in my_microbatches:
        nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100)
        (nll * scale).backward()
    ```
    """
    if isinstance(global_num_tokens, bool) or int(global_num_tokens) != global_num_tokens or global_num_tokens <= 0:
        raise ValueError(
            f"global_num_tokens must be a positive integer (label tokens of the whole step), got {global_num_tokens!r}"
        )
    if isinstance(world_size, bool) or int(world_size) != world_size or world_size <= 0:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    return world_size / global_num_tokens


def batch_mean_weight(rows: int, total_rows: float, world_size: int) -> float:
    """Factor that turns a microbatch's loss averaged over its own rows into its share of the step's loss.

    With ``rows x W / total_rows`` per microbatch (``total_rows``: the rows of the whole step over all ranks), FSDP2's
    average over the ``W`` ranks gives the mean over every row of the step, whichever rank or microbatch a row ran in
    (one process's mean over the global batch). DPO and the reward trainer count pairs as rows, RLOO sequences.
    """
    return rows * world_size / float(max(total_rows, 1))
