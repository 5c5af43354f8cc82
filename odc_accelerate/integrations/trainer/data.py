"""The balanced step's data path: one dataloader item is one rank's whole optimizer step (its microbatches)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["StepCollator", "StepDataLoader", "StepDataset", "input_tokens", "merge_for_counting"]


class StepDataLoader(DataLoader):
    """A DataLoader whose items are whole steps; it skips on resume through its sampler (see the mixin's
    ``_run_epoch``)."""

    # Tells the transformers compat module's skip_first_batches pass-through to leave this loader alone.
    _odc_skips_itself = True


class StepDataset(Dataset):
    """Fetches a whole step: ``dataset[[[i, j], [k]]]`` -> ``[[row_i, row_j], [row_k]]``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, microbatches: list[list[int]]) -> list[list[Any]]:
        return [[self.dataset[i] for i in mb] for mb in microbatches]


class StepCollator:
    """Collates each microbatch of a step with the trainer's own collator."""

    def __init__(self, collator: Any) -> None:
        self.collator = collator

    def __call__(self, step: list[list[Any]]) -> list[Any]:
        return [self.collator(features) for features in step if features]


def input_tokens(batch: dict) -> int:
    """Non-padding input tokens of a collated batch."""
    if "attention_mask" in batch and batch["attention_mask"] is not None:
        return int(batch["attention_mask"].sum())
    if "position_ids" in batch:
        return int(batch["position_ids"].numel())
    ids = batch.get("input_ids")
    return int(ids.numel()) if ids is not None else 0


def merge_for_counting(microbatches: list[dict], main: str) -> dict:
    """One batch holding every microbatch's ``main`` input (and attention mask), for the Trainer's token count."""
    if not microbatches:
        return {main: torch.zeros(0, dtype=torch.long)}
    out = {main: torch.cat([mb[main].reshape(-1) for mb in microbatches])}
    if all("attention_mask" in mb for mb in microbatches):
        out["attention_mask"] = torch.cat([mb["attention_mask"].reshape(-1) for mb in microbatches])
    return out
