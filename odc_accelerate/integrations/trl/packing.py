"""DPO without padding: a microbatch's pairs packed into one row, chosen and rejected each its own sequence.

TRL 1.16 turns DPO's ``padding_free`` off and pads every row of a microbatch to its longest. With
``padding_free=True`` the ODC trainer packs each planned microbatch instead (`PackedPairs`: one row, ``position_ids``
restarting at 0 for each sequence, no attention mask, in TRL's row order: every chosen, then every rejected). TRL's
loss reads padded ``(rows, width)`` tensors, so the trainer hands it the padded view of that row (`padded_view`) and
runs each forward of the policy and the reference packed (`packed_forward`): the forward's inputs are packed again,
and the per-token outputs of TRL's fused LM head scattered back to the padded rows. transformers (5.x) keeps packed
sequences apart from their ``position_ids`` alone when no attention mask is given (``masking_utils``: a block-diagonal
causal mask for eager, sdpa and flex attention; the flash kernels' varlen path); a recurrent layer needs its kernels
and the sequence boundaries (`odc_accelerate.hybrid`). Where packing cannot keep the sequences apart
(`pair_packing_obstacle`), the trainer trains padded rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "PACKING_ATTENTION",
    "PackedPairs",
    "is_packed",
    "pack_rows",
    "packed_forward",
    "padded_view",
    "pair_packing_obstacle",
]

#: Attention implementations that keep sequences packed in one row apart from their ``position_ids`` (transformers
#: 5.x builds the block-diagonal mask for the first three; the flash kernels read the boundaries from the positions).
PACKING_ATTENTION = frozenset({"eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3"})

#: Keyword arguments of TRL's DPO forwards that a packed forward serves; a call with any other stays padded.
_FORWARD_KEYS = frozenset(
    {"input_ids", "attention_mask", "labels", "fused_lm_head", "use_cache", "output_router_logits"}
)


def pair_packing_obstacle(trainer: Any) -> str | None:
    """Why ``trainer``'s pairs cannot be packed into one row per microbatch, or `None` when they can."""
    from ..._compat.transformers import attention_implementation
    from ..._compat.trl import is_vision_dataset
    from ...hybrid import missing_packing_kernels

    model = trainer.model
    if is_vision_dataset(trainer):
        return "the training set has images, which TRL's vision collator places by row"
    peft_config = getattr(model, "active_peft_config", None)
    if getattr(peft_config, "is_prompt_learning", False):
        return "prompt-learning PEFT prepends its virtual tokens to every row"
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    implementation = attention_implementation(text_config) if text_config is not None else None
    if implementation not in PACKING_ATTENTION:
        return (
            f"attention implementation {implementation!r} is not one known to keep packed sequences apart "
            f"({', '.join(sorted(PACKING_ATTENTION))})"
        )
    missing = missing_packing_kernels(model)
    if missing:
        return (
            "its recurrent (linear-attention) layers would carry one sequence's state into the next; they keep packed "
            f"sequences apart only with {' and '.join(missing)} installed"
        )
    return None


def is_packed(batch: Any) -> bool:
    """Whether ``batch`` is one packed row (`pack_rows`): ``position_ids``, no attention mask, one row."""
    position_ids = batch.get("position_ids") if isinstance(batch, dict) else None
    return batch.get("attention_mask") is None and position_ids is not None and position_ids.shape[0] == 1


def _row_lengths(mask: torch.Tensor) -> torch.Tensor | None:
    """Each row's tokens when every row is right-padded and none is empty, else `None`."""
    lengths = mask.sum(dim=1)
    prefix = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    if bool((lengths == 0).any()) or not torch.equal(prefix, mask):
        return None
    return lengths


def _positions(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.arange(int(n), device=lengths.device) for n in lengths.tolist()])


def pack_rows(batch: dict) -> dict:
    """TRL's padded preference batch as one packed row: ``input_ids``, ``completion_mask`` and ``position_ids`` of
    shape ``(1, real tokens)``, rows in their order; per-pair values (the precomputed reference log-probs) as they are.

    Raises:
        ValueError: a row is left-padded or empty (a custom collator), which a packed row cannot represent.
    """
    mask = batch["attention_mask"].bool()
    lengths = _row_lengths(mask)
    if lengths is None:
        raise ValueError(
            "padding_free=True packs TRL's right-padded preference rows, but this collator's rows are left-padded or "
            "empty. Use TRL's DataCollatorForPreference, or pass --padding_free false."
        )
    out = {key: value for key, value in batch.items() if key not in ("input_ids", "attention_mask", "completion_mask")}
    out["input_ids"] = batch["input_ids"][mask][None]
    out["completion_mask"] = batch["completion_mask"][mask][None]
    out["position_ids"] = _positions(lengths)[None]
    return out


def padded_view(batch: dict, pad_token_id: int = 0) -> dict:
    """A packed row (`pack_rows`) as TRL's right-padded rows (``input_ids``, ``attention_mask``, ``completion_mask``),
    the other keys as they are; a batch that is not packed is returned unchanged."""
    if not is_packed(batch):
        return batch
    position_ids = batch["position_ids"][0]
    starts = (position_ids == 0).nonzero().flatten()
    lengths = torch.diff(starts, append=torch.tensor([position_ids.numel()], device=starts.device))
    width = int(lengths.max())
    mask = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
    out = {key: value for key, value in batch.items() if key not in ("input_ids", "completion_mask", "position_ids")}
    for key, fill in (("input_ids", pad_token_id), ("completion_mask", 0)):
        row = batch[key][0]
        out[key] = row.new_full(mask.shape, fill).masked_scatter(mask, row)
    out["attention_mask"] = mask.long()
    return out


class PackedPairs:
    """Collates a microbatch of preference pairs with TRL's collator, then packs its rows into one (`pack_rows`)."""

    def __init__(self, collator: Any) -> None:
        self.collator = collator

    def __call__(self, features: list[Any]) -> dict:
        return pack_rows(self.collator(features))


@dataclass(frozen=True)
class _Layout:
    """Where a packed forward's tokens sit in the padded rows: ``mask`` ``(rows, width)``, the packed positions kept
    in the per-token outputs (``keep``: all but each sequence's last, whose next-token label lies in the next
    sequence)."""

    mask: torch.Tensor
    keep: torch.Tensor


def _pack_call(args: tuple, kwargs: dict, boundaries: bool) -> tuple[dict, _Layout] | None:
    """A DPO forward's keyword arguments packed into one row with the layout to unpack it, or `None` where the call is
    not one to pack (not TRL's fused head, other inputs, already packed, rows not right-padded)."""
    if args or not kwargs.get("fused_lm_head") or not set(kwargs) <= _FORWARD_KEYS:
        return None
    ids, attention, labels = kwargs.get("input_ids"), kwargs.get("attention_mask"), kwargs.get("labels")
    if ids is None or attention is None or labels is None or ids.dim() != 2 or labels.shape != ids.shape:
        return None
    mask = attention.bool()
    lengths = _row_lengths(mask)
    if lengths is None:
        return None
    ends = torch.cumsum(lengths, 0)
    packed_labels = labels[mask].clone()
    packed_labels[ends[:-1]] = -100  # a sequence's first token is no target of the one before it
    packed = {k: v for k, v in kwargs.items() if k != "attention_mask"}
    packed.update(input_ids=ids[mask][None], labels=packed_labels[None], position_ids=_positions(lengths)[None])
    if boundaries:
        from ...hybrid import with_sequence_boundaries

        packed = with_sequence_boundaries(packed)
    keep = torch.ones(int(ends[-1]) - 1, dtype=torch.bool, device=ids.device)
    keep[ends[:-1] - 1] = False
    return packed, _Layout(mask=mask, keep=keep)


def _unpack_output(output: Any, layout: _Layout, fields: Iterable[str]) -> Any:
    """The per-token ``fields`` of a packed forward's ``output`` (``(1, tokens - 1)``) scattered to the padded rows
    (``(rows, width - 1)``, zero where the row has no next token), as TRL's padded forward returns them."""
    target = layout.mask[:, 1:]
    for name in fields:
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] == 1:
            setattr(output, name, value.new_zeros(target.shape).masked_scatter(target, value[0, layout.keep]))
    return output


@contextlib.contextmanager
def packed_forward(modules: Iterable[Any], boundaries: bool = False) -> Iterator[list[tuple[int, int]]]:
    """Within the block, each TRL DPO forward (``labels=..., fused_lm_head=True``) of ``modules`` on right-padded rows
    runs on those rows packed into one, and returns its per-token outputs in the padded rows' shape. Yields the list
    of the forwards that ran packed, ``(rows, tokens)`` each, filled as they run.

    Args:
        modules: the policy and the reference model (each called as TRL calls it; duplicates are ignored).
        boundaries (`bool`, *optional*, defaults to `False`): also pass the sequence boundaries recurrent kernels read
            (`odc_accelerate.hybrid.with_sequence_boundaries`).
    """
    from ..._compat.trl.dpo import fused_per_token_fields

    fields = fused_per_token_fields()
    layouts: list[_Layout | None] = []  # a stack: a wrapper's forward calls the module it wraps
    ran: list[tuple[int, int]] = []

    def pre(module: Any, args: tuple, kwargs: dict) -> Any:
        packed = _pack_call(args, kwargs, boundaries)
        layouts.append(None if packed is None else packed[1])
        if packed is None:
            return None
        ran.append((int(packed[1].mask.shape[0]), int(packed[0]["input_ids"].shape[1])))
        return (), packed[0]

    def post(module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        layout = layouts.pop()
        return None if layout is None else _unpack_output(output, layout, fields)

    handles = []
    seen: set[int] = set()
    try:
        for module in modules:
            if module is None or id(module) in seen:
                continue
            seen.add(id(module))
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
        yield ran
    finally:
        for handle in handles:
            handle.remove()
