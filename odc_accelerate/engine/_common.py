"""The types the engine's modules share (as torch's ``_fsdp_common.py``): a leaf, so that none imports another back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from . import model_check


@dataclass
class ServedGroup:
    """One FSDP2 param group as the engine sees it."""

    index: int
    fqn: str
    group: Any  # FSDPParamGroup
    module: nn.Module
    gather_numel: int
    gather_dtype: torch.dtype
    reduce_numel: int
    reduce_dtype: torch.dtype | None
    saved_comms: tuple[Any, Any]
    saved_flags: tuple[bool, bool]
    touched: bool = False
    saved_keep: Any = None  # keep_compat.KeepFlags: the user's FSDP2 switches that the memory policy changes
    keep: tuple[bool, bool] = (False, False)  # (gathered params, unsharded grads) kept through the step


@dataclass
class Served:
    """The param groups an engine serves and the mesh they live on, agreed by every rank (`_setup.serve`)."""

    entries: list[model_check.Entry]
    layouts: list[tuple[int, torch.dtype]]  # per group: the all-gather input's numel and dtype
    shard_pg: Any  # the shard group's process group: the engine's ranks
    replicate_pg: Any  # HSDP: the replicas' process group; None on a 1-D mesh
    device: torch.device
