"""GRPO's generated completions, re-batched: one row per completion (`split_rollouts`), and microbatches of the rows
a plan gives a rank, padded as TRL pads them (`collate_rollouts`). Which keys are per token and per completion is
pinned in `odc_accelerate._compat.trl.grpo`."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from ..._compat.trl import grpo as trl_grpo

__all__ = ["collate_rollouts", "loss_tokens", "split_rollouts"]


def split_rollouts(batch: dict[str, Any], sequence_keys: Collection[str] = ()) -> list[dict[str, torch.Tensor]]:
    """One dict of CPU tensors per completion of a GRPO generation batch, without padding.

    ``prompt_ids`` / ``prompt_mask`` keep the prompt's tokens (TRL pads prompts on the left); the per-token keys of
    `odc_accelerate._compat.trl.grpo.GRPO_TOKEN_KEYS` keep the completion's first ``c`` positions, ``c`` being one past
    its last position with ``completion_mask == 1`` (0 for a completion TRL masked out entirely); ``advantages`` keeps
    its value. A key of `odc_accelerate._compat.trl.grpo.GRPO_TOKEN_OR_SEQUENCE_KEYS` (vLLM's importance-sampling
    ratio) is per token like those, or, when it is in ``sequence_keys``, one value per completion of shape ``(1,)``
    (TRL's ``(B, 1)`` in the ``sequence_*`` importance-sampling modes).

    Raises:
        ValueError: the batch holds a key the ODC plan cannot re-batch (images and other model inputs), or a key of
            an unexpected shape.
    """
    token_or_sequence = set(trl_grpo.GRPO_TOKEN_OR_SEQUENCE_KEYS)
    known = (
        set(trl_grpo.GRPO_TOKEN_KEYS)
        | set(trl_grpo.GRPO_SAMPLE_KEYS)
        | set(trl_grpo.GRPO_PROMPT_KEYS)
        | token_or_sequence
    )
    unknown = sorted(k for k in batch if k not in known and k != "num_items_in_batch")
    if unknown:
        raise ValueError(
            f"ODC's balanced GRPO plan re-batches completions across ranks and cannot carry {unknown} (multimodal "
            "inputs). Run without --odc / --odc_plan, or without these inputs."
        )
    prompt_mask = batch["prompt_mask"].detach().cpu()
    completion_mask = batch["completion_mask"].detach().cpu()
    positions = torch.arange(1, completion_mask.shape[1] + 1)
    completion_lengths = (completion_mask.bool() * positions).amax(dim=1) if completion_mask.numel() else None
    prompt_lengths = prompt_mask.sum(dim=1)
    rows = []
    for i in range(prompt_mask.shape[0]):
        p = int(prompt_lengths[i])
        c = int(completion_lengths[i]) if completion_lengths is not None else 0
        row = {key: batch[key][i, batch[key].shape[1] - p :].detach().cpu() for key in trl_grpo.GRPO_PROMPT_KEYS}
        for key in (*trl_grpo.GRPO_TOKEN_KEYS, *token_or_sequence):
            value = batch.get(key)
            if value is None:
                continue
            if key in sequence_keys:
                if value.dim() != 2 or value.shape[1] != 1:
                    raise ValueError(
                        f"ODC's balanced GRPO plan expects one `{key}` value per completion here, of shape (B, 1), "
                        f"got {tuple(value.shape)}. Run without --odc / --odc_plan."
                    )
                row[key] = value[i].detach().cpu()
            else:
                if value.dim() != 2 or value.shape[1] != completion_mask.shape[1]:
                    raise ValueError(
                        f"ODC's balanced GRPO plan expects one `{key}` value per completion token, of shape "
                        f"{tuple(completion_mask.shape)}, got {tuple(value.shape)}. Run without --odc / --odc_plan."
                    )
                row[key] = value[i, :c].detach().cpu()
        for key in trl_grpo.GRPO_SAMPLE_KEYS:
            if batch[key].dim() != 1:
                raise ValueError(
                    f"ODC's balanced GRPO plan expects one `{key}` value per completion, got shape "
                    f"{tuple(batch[key].shape)}. Run without --odc / --odc_plan."
                )
            row[key] = batch[key][i].detach().cpu()
        rows.append(row)
    return rows


def collate_rollouts(
    rows: list[dict[str, torch.Tensor]], pad_token_id: int, device: Any, sequence_keys: Collection[str] = ()
) -> dict[str, Any]:
    """A GRPO training microbatch of ``rows`` (from `split_rollouts`, with the same ``sequence_keys``), padded as TRL
    pads one: prompts on the left, completions on the right (at least one column, so that ``logits_to_keep`` is never
    0)."""
    width_p = max(int(r["prompt_ids"].numel()) for r in rows)
    width_c = max(1, max(int(r["completion_ids"].numel()) for r in rows))
    out: dict[str, Any] = {}
    for key, value in (("prompt_ids", pad_token_id), ("prompt_mask", 0)):
        out[key] = torch.stack(
            [torch.cat([r[key].new_full((width_p - r[key].numel(),), value), r[key]]) for r in rows]
        )
    for key, value in (*trl_grpo.GRPO_TOKEN_KEYS.items(), *trl_grpo.GRPO_TOKEN_OR_SEQUENCE_KEYS.items()):
        if key not in rows[0]:
            continue
        if key in sequence_keys:
            out[key] = torch.stack([r[key] for r in rows])
            continue
        value = pad_token_id if value is None else value
        out[key] = torch.stack(
            [torch.cat([r[key], r[key].new_full((width_c - r[key].numel(),), value)]) for r in rows]
        )
    for key in trl_grpo.GRPO_SAMPLE_KEYS:
        out[key] = torch.stack([r[key] for r in rows])
    return {k: v.to(device) for k, v in out.items()}


def loss_tokens(batch: dict[str, Any]) -> torch.Tensor:
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if batch.get("tool_mask") is not None else mask
