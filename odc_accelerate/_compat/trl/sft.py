"""TRL's SFTTrainer: the metric gathers it makes per microbatch, and its dataset preparation with ``max_length``."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

from .. import check_signature, patched_attribute, require, warn_if_untested
from . import _LIBRARY, is_vision_dataset  # noqa: F401  (SFT's collator tokenizes vision samples per batch)

# Scalars SFTTrainer.compute_loss gathers per training microbatch, in call order.
SFT_TRAIN_GATHERS = ("num_valid", "entropy_sum", "num_correct", "num_tokens")


def check_sft(trainer: Any) -> None:
    """Raise `~odc_accelerate._compat.CompatError` if the SFT trainer lacks the metric attributes the ODC deferral
    rewrites.

    The order of TRL's gathers cannot be checked from outside; on an untested TRL version a warning says so.
    """
    detail = (
        "odc_accelerate reads the SFT metric gathers in the order of the tested versions "
        f"({', '.join(SFT_TRAIN_GATHERS)}); if TRL changed them, the logged entropy / mean_token_accuracy / "
        "num_tokens may be wrong (the loss and training are unaffected)."
    )
    warn_if_untested(_LIBRARY, detail)
    for attr in ("_metrics", "_total_train_tokens"):
        require(trainer, attr, library=_LIBRARY, where="trl.SFTTrainer")


@contextlib.contextmanager
def sft_padding_free_with_max_length(trainer: Any, args: Any) -> Iterator[None]:
    """Within the block (``SFTTrainer.__init__``), ``padding_free=True`` works together with ``max_length``.

    TRL refuses the pair without packing, since a padding-free batch of several sequences is one row that can exceed
    ``max_length``. Under a balanced ODC plan every microbatch is bounded by the plan's token budget instead, so the
    pair is well defined: TRL's check sees ``max_length=None`` while each sample is still truncated to
    ``max_length`` in TRL's own ``SFTTrainer._prepare_dataset`` (patched on this trainer only, for the block).
    """
    from trl import SFTTrainer

    where = "trl.SFTTrainer"
    advice = "Pass --padding_free false, or pre-truncate the data and pass --max_length None."
    method = require(SFTTrainer, "_prepare_dataset", library=_LIBRARY, where=where, advice=advice)
    check_signature(method, ("args",), library=_LIBRARY, where=f"{where}._prepare_dataset")
    max_length = args.max_length

    def wrap(original: Any) -> Any:
        signature = inspect.signature(original)  # bound: without `self`

        @functools.wraps(original)
        def _prepare_dataset(*call_args: Any, **call_kwargs: Any) -> Any:
            prep_args = signature.bind(*call_args, **call_kwargs).arguments["args"]
            prep_args.max_length = max_length
            try:
                return original(*call_args, **call_kwargs)
            finally:
                prep_args.max_length = None

        return _prepare_dataset

    with patched_attribute(trainer, "_prepare_dataset", wrap, library=_LIBRARY, where=where):
        args.max_length = None
        try:
            yield
        finally:
            args.max_length = max_length
