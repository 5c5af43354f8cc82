"""Generated completions (GRPO, RLOO), re-batched: one row per completion (`split_rollouts`), and microbatches of the
rows a plan gives a rank, padded as TRL pads them (`collate_rollouts`). Which keys are per token and per completion is
pinned in `odc_accelerate._compat.trl.grpo` (GRPO) and `odc_accelerate._compat.trl.rloo` (RLOO), and named here by a
`RolloutKeys`."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..._compat.trl import grpo as trl_grpo

__all__ = ["GRPO_KEYS", "RolloutKeys", "collate_rollouts", "loss_tokens", "split_rollouts", "step_slices"]


@dataclass(frozen=True)
class RolloutKeys:
    """The keys of a trainer's generation batch, by kind.

    Args:
        prompt (`tuple[str, ...]`): the left-padded prompt's ids and mask.
        token (`Mapping[str, Any]`): one value per completion token -> the value it is right-padded with (`None`: the
            tokenizer's pad token id).
        sample (`tuple[str, ...]`): one value per completion.
        token_or_sequence (`Mapping[str, Any]`): per token, or one per completion when named in ``sequence_keys``.
    """

    prompt: tuple[str, ...]
    token: Mapping[str, Any]
    sample: tuple[str, ...]
    token_or_sequence: Mapping[str, Any] = field(default_factory=dict)

    def known(self) -> set[str]:
        return set(self.prompt) | set(self.token) | set(self.sample) | set(self.token_or_sequence)


#: GRPOTrainer's generation batch (`odc_accelerate._compat.trl.grpo`).
GRPO_KEYS = RolloutKeys(
    prompt=tuple(trl_grpo.GRPO_PROMPT_KEYS),
    token=trl_grpo.GRPO_TOKEN_KEYS,
    sample=tuple(trl_grpo.GRPO_SAMPLE_KEYS),
    token_or_sequence=trl_grpo.GRPO_TOKEN_OR_SEQUENCE_KEYS,
)


def split_rollouts(
    batch: dict[str, Any], sequence_keys: Collection[str] = (), keys: RolloutKeys = GRPO_KEYS
) -> list[dict[str, torch.Tensor]]:
    """One dict of CPU tensors per completion of a generation batch (``keys``: GRPO's by default), without padding.

    ``prompt_ids`` / ``prompt_mask`` keep the prompt's tokens (TRL pads prompts on the left); the per-token keys of
    ``keys.token`` (GRPO: `odc_accelerate._compat.trl.grpo.GRPO_TOKEN_KEYS`) keep the completion's first ``c``
    positions, ``c`` being one past its last position with ``completion_mask == 1`` (0 for a completion TRL masked out
    entirely); the keys of ``keys.sample`` (``advantages``; RLOO's ``old_logps``) keep their value. A key of
    ``keys.token_or_sequence`` (vLLM's importance-sampling ratio) is per token like those, or, when it is in
    ``sequence_keys``, one value per completion of shape ``(1,)`` (TRL's ``(B, 1)`` in the ``sequence_*``
    importance-sampling modes).

    Raises:
        ValueError: the batch holds a key the ODC plan cannot re-batch (images and other model inputs), or a key of
            an unexpected shape.
    """
    token_or_sequence = set(keys.token_or_sequence)
    known = keys.known()
    unknown = sorted(k for k in batch if k not in known and k != "num_items_in_batch")
    if unknown:
        raise ValueError(
            f"ODC's balanced plan re-batches completions across ranks and cannot carry {unknown} (multimodal "
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
        row = {key: batch[key][i, batch[key].shape[1] - p :].detach().cpu() for key in keys.prompt}
        for key in (*keys.token, *token_or_sequence):
            value = batch.get(key)
            if value is None:
                continue
            if key in sequence_keys:
                if value.dim() != 2 or value.shape[1] != 1:
                    raise ValueError(
                        f"ODC's balanced plan expects one `{key}` value per completion here, of shape (B, 1), "
                        f"got {tuple(value.shape)}. Run without --odc / --odc_plan."
                    )
                row[key] = value[i].detach().cpu()
            else:
                if value.dim() != 2 or value.shape[1] != completion_mask.shape[1]:
                    raise ValueError(
                        f"ODC's balanced plan expects one `{key}` value per completion token, of shape "
                        f"{tuple(completion_mask.shape)}, got {tuple(value.shape)}. Run without --odc / --odc_plan."
                    )
                row[key] = value[i, :c].detach().cpu()
        for key in keys.sample:
            if batch[key].dim() != 1:
                raise ValueError(
                    f"ODC's balanced plan expects one `{key}` value per completion, got shape "
                    f"{tuple(batch[key].shape)}. Run without --odc / --odc_plan."
                )
            row[key] = batch[key][i].detach().cpu()
        rows.append(row)
    return rows


def collate_rollouts(
    rows: list[dict[str, torch.Tensor]],
    pad_token_id: int,
    device: Any,
    sequence_keys: Collection[str] = (),
    keys: RolloutKeys = GRPO_KEYS,
) -> dict[str, Any]:
    """A training microbatch of ``rows`` (from `split_rollouts`, with the same ``sequence_keys`` and ``keys``), padded
    as TRL pads one: prompts on the left, completions on the right (at least one column, so that ``logits_to_keep`` is
    never 0)."""
    width_p = max(int(r["prompt_ids"].numel()) for r in rows)
    width_c = max(1, max(int(r["completion_ids"].numel()) for r in rows))
    out: dict[str, Any] = {}
    for key, value in zip(keys.prompt, (pad_token_id, 0), strict=True):
        out[key] = torch.stack(
            [torch.cat([r[key].new_full((width_p - r[key].numel(),), value), r[key]]) for r in rows]
        )
    for key, value in (*keys.token.items(), *keys.token_or_sequence.items()):
        if key not in rows[0]:
            continue
        if key in sequence_keys:
            out[key] = torch.stack([r[key] for r in rows])
            continue
        value = pad_token_id if value is None else value
        out[key] = torch.stack(
            [torch.cat([r[key], r[key].new_full((width_c - r[key].numel(),), value)]) for r in rows]
        )
    for key in keys.sample:
        out[key] = torch.stack([r[key] for r in rows])
    return {k: v.to(device) for k, v in out.items()}


def step_slices(per_rank: list[list[Any]], steps: int) -> list[list[Any]]:
    """The completions of each of ``steps`` optimizer steps fed by one generation batch, from every rank's rows of it
    (``per_rank[r]``, in the order TRL slices them: shuffled as TRL shuffles them): step ``j`` takes the ``j``-th of
    ``steps`` equal parts of every rank's rows, as TRL's step ``j`` trains the ``gradient_accumulation_steps`` slices
    ``j x ga ..`` of every rank's ``steps_per_generation`` slices.

    Raises:
        ValueError: a rank's rows do not split into ``steps`` equal parts.
    """
    parts = []
    for rows in per_rank:
        if len(rows) % steps:
            raise ValueError(
                f"A rank's generation batch of {len(rows)} completions does not split into {steps} optimizer steps "
                "(steps_per_generation / gradient_accumulation_steps); every rank's generation batch must hold "
                "per_device_train_batch_size x steps_per_generation completions."
            )
        parts.append(len(rows) // steps)
    return [
        [row for rows, n in zip(per_rank, parts, strict=True) for row in rows[j * n : (j + 1) * n]]
        for j in range(steps)
    ]


def loss_tokens(batch: dict[str, Any]) -> torch.Tensor:
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if batch.get("tool_mask") is not None else mask
