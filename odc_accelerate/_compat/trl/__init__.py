"""Every TRL internal that odc_accelerate reads or patches, one module per concern, checked against the installed TRL.

`sft`, `dpo`, `grpo`, `reward`, `rloo` pin each trainer's metric gathers per microbatch (their order and the attributes
they feed, which the ODC trainers answer locally and fix at the step boundary) and what else it needs; `lm_head` the
fused LM head of TRL 1.15; `classes` the names the bootstrap replaces. This package holds what they share: the metrics
a trainer records and the swap of a module's ``prepare_fsdp`` (for a ``with`` block only). Details: docs/versions.md,
"What `_compat/` pins". The tested versions are ``TESTED["trl"]``; the gather orders pinned here are theirs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from .. import check_signature, patched_attribute, require

_LIBRARY = "trl"


@contextlib.contextmanager
def _reference_preparer(module: Any, where: str, prepare: Any) -> Iterator[None]:
    """Within the block, the TRL trainer module ``module`` (named ``where`` in messages) prepares its reference model
    under FSDP with ``prepare(model, accelerator, trl_prepare)`` instead of its ``prepare_fsdp``, which
    ``trl_prepare(model, accelerator)`` still calls."""
    current = require(module, "prepare_fsdp", library=_LIBRARY, where=where)
    check_signature(current, ("model", "accelerator"), library=_LIBRARY, where=f"{where}.prepare_fsdp")

    def wrap(original: Any) -> Any:
        def trl_prepare(model: Any, accelerator: Any) -> Any:
            return original(model=model, accelerator=accelerator)

        @functools.wraps(original)
        def prepare_fsdp(model: Any, accelerator: Any) -> Any:
            return prepare(model, accelerator, trl_prepare)

        return prepare_fsdp

    with patched_attribute(module, "prepare_fsdp", wrap, library=_LIBRARY, where=where):
        yield


# ------------------------------------------------------------------------------------------------ recorded metrics
def train_metrics(trainer: Any) -> dict[str, list]:
    """The training metrics a TRL trainer records per microbatch and averages at each log (``trainer._metrics``)."""
    return require(trainer, "_metrics", library=_LIBRARY, where=type(trainer).__name__)["train"]


def count_train_tokens(trainer: Any, global_tokens: float, local_tokens: float) -> None:
    """Record the input tokens of a whole step over all ranks in TRL's running count (``_total_train_tokens``, logged
    as ``num_tokens``), where the trainer's own per-microbatch gathers were answered with this rank's
    ``local_tokens``."""
    tp = int(getattr(trainer, "_tp_size", 1) or 1)
    total = require(trainer, "_total_train_tokens", library=_LIBRARY, where=type(trainer).__name__)
    trainer._total_train_tokens = total + int(global_tokens) // tp - int(local_tokens) // tp
    train_metrics(trainer)["num_tokens"] = [trainer._total_train_tokens]


def is_vision_dataset(trainer: Any) -> bool:
    """Whether TRL's trainer (SFT, DPO, KTO) found images (``image`` / ``images``) in its training set: its collator then
    tokenizes and processes each microbatch's samples on the fly, expanding each image placeholder to its tokens."""
    return bool(require(trainer, "_is_vision_dataset", library=_LIBRARY, where=type(trainer).__name__))
