"""Every transformers Trainer internal that odc_accelerate overrides or reads, in one place, checked at start-up.

The Trainer has no public hook to pass an Accelerator plugin, to loop a rank's own microbatches inside one optimizer
step, to know the epoch a dataloader is built for, or to act after a checkpoint is loaded; the ODC mixin overrides
the private methods below. :func:`check` verifies they exist (with the keyword arguments the mixin relies on) and
raises naming what is missing, so a transformers upgrade fails at trainer construction instead of training wrongly.

Tested against transformers 5.23.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

logger = logging.getLogger(__name__)

TESTED_TRANSFORMERS = ((5, 23),)

# method -> parameters the mixin passes or reads
_METHODS = {
    "create_accelerator_and_postprocess": (),
    "_build_accelerator_args": (),
    "get_batch_samples": ("epoch_iterator", "num_batches", "device"),
    "training_step": ("model", "inputs", "num_items_in_batch"),
    "_run_epoch": (
        "epoch",
        "train_dataloader",
        "resume_from_checkpoint",
        "epochs_trained",
        "steps_trained_in_current_epoch",
    ),
    "_load_from_checkpoint": ("resume_from_checkpoint",),
    "_track_num_input_tokens": ("inputs",),
    "_remove_unused_columns": ("dataset",),
    "floating_point_ops": ("inputs",),
}


class TransformersCompatError(RuntimeError):
    """The installed transformers lacks a Trainer internal that odc_accelerate relies on."""


def _missing(what: str) -> str:
    import transformers

    tested = ", ".join(f"{a}.{b}" for a, b in TESTED_TRANSFORMERS)
    return (
        f"odc_accelerate needs the transformers internal `{what}`, which transformers {transformers.__version__} does "
        f"not have (tested with transformers {tested}). Install a supported transformers "
        "(pip install 'odc_accelerate[hf]') or upgrade odc_accelerate."
    )


def check() -> None:
    """Raise `TransformersCompatError` if a Trainer internal the ODC mixin overrides is missing or changed shape."""
    import transformers
    from transformers import Trainer

    major, minor = (int("".join(c for c in x if c.isdigit()) or 0) for x in transformers.__version__.split(".")[:2])
    if (major, minor) not in TESTED_TRANSFORMERS:
        logger.warning(
            "odc_accelerate was tested with transformers %s, found %s; the Trainer internals it overrides are checked "
            "but their behaviour may differ.",
            TESTED_TRANSFORMERS,
            transformers.__version__,
        )
    for name, params in _METHODS.items():
        fn = getattr(Trainer, name, None)
        if fn is None:
            raise TransformersCompatError(_missing(f"Trainer.{name}"))
        have = inspect.signature(fn).parameters
        for p in params:
            if p not in have:
                raise TransformersCompatError(_missing(f"Trainer.{name}({p}=...)"))


def loss_shifts_labels(trainer: Any) -> bool:
    """Whether the model's loss shifts labels (causal LM): then label tokens are counted over ``labels[..., 1:]``."""
    return bool(getattr(trainer, "_loss_shifts_labels", True))


def count_label_tokens(trainer: Any, batch: dict) -> int:
    """Label tokens of one collated microbatch, counted as the Trainer's ``_get_num_items_in_batch`` counts them."""
    if "shift_labels" in batch:
        labels = batch["shift_labels"]
    elif "labels" in batch:
        labels = batch["labels"][..., 1:] if loss_shifts_labels(trainer) else batch["labels"]
    else:
        return 0
    return int(labels.ne(-100).sum())


_SKIP_PATCHED = False


def passthrough_skip_first_batches(attr: str = "_odc_skips_itself") -> None:
    """Make the Trainer's resume-time ``skip_first_batches`` a no-op for dataloaders marked with ``attr``.

    On resume the Trainer re-creates the dataloader through accelerate's ``skip_first_batches`` (imported into
    ``transformers.trainer``), which cannot wrap a dataloader whose sampler yields whole steps. The ODC mixin
    fast-forwards its deterministic sampler itself (``load_state_dict``), so such a loader is returned unchanged.
    """
    global _SKIP_PATCHED
    if _SKIP_PATCHED:
        return
    import functools

    import transformers.trainer as trainer_mod

    original = getattr(trainer_mod, "skip_first_batches", None)
    if original is None:
        raise TransformersCompatError(_missing("transformers.trainer.skip_first_batches"))

    @functools.wraps(original)
    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        if getattr(dataloader, attr, False):
            return dataloader
        return original(dataloader, num_batches)

    trainer_mod.skip_first_batches = skip_first_batches
    _SKIP_PATCHED = True


def batch_rebalance_global_plans(
    lengths: list[int], effective_batch_size: int, dp_size: int, grad_accum: int
) -> list[list[list[list[int]]]]:
    """Every rank's microbatches from transformers' ``BatchRebalanceSampler``, step by step (for benchmarks).

    The sampler computes the whole step's assignment on every rank (``_assign``) and yields its own row
    (``_yield_global_batch``); capturing the row list once gives all ranks' plans without building one sampler per
    rank. ``shuffle=False``: the caller passes lengths already in its step order.
    """
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    for attr in ("_assign", "_yield_global_batch"):
        if not hasattr(BatchRebalanceSampler, attr):
            raise TransformersCompatError(_missing(f"BatchRebalanceSampler.{attr}"))

    class _Capture(BatchRebalanceSampler):
        def _yield_global_batch(self, batch_indices):
            yield self._assign(batch_indices, [self.lengths[i] for i in batch_indices])

    sampler = _Capture(
        lengths=list(lengths),
        effective_batch_size=effective_batch_size,
        dp_size=dp_size,
        grad_accum=grad_accum,
        shuffle=False,
        rank=0,
        drop_last=True,
    )
    return list(sampler)
