"""Every TRL internal that odc_accelerate reads or patches, one module per concern, checked against the installed TRL.

* `sft`: the order and meaning of SFTTrainer's metric gathers per microbatch, and ``SFTTrainer._prepare_dataset``
  (padding-free data with ``max_length``);
* `dpo`: DPOTrainer's metric gathers, and the module-level ``prepare_fsdp`` name it prepares its reference model with;
* `grpo`: GRPOTrainer's completions, loss normalisations and metric calls, and the hooks on its vLLM generation;
* `lm_head`: the fused LM head of TRL 1.15 (``add_fused_lm_head``, ``_ChunkedLogProbFunction``), given a torch path
  on CPU;
* `classes`: the public class names that `odc_accelerate.cli.bootstrap` replaces with the ODC trainers.

This package holds what they share: the metrics a TRL trainer records, and the swap of a trainer module's
``prepare_fsdp``. Patches last for a ``with`` block only (the class swap, until it is undone).

TRL's trainers call ``accelerator.gather_for_metrics`` several times per microbatch and fold the results into
``self._metrics`` and ``self._total_train_tokens``. The ODC trainers answer those gathers locally during the
microbatches and fix the recorded values at the step boundary; that needs the ORDER of the gathers and the names of
the attributes they feed, which are private to TRL and pinned in these modules.

The tested TRL versions are ``TESTED["trl"]`` in :mod:`odc_accelerate._compat`; the gather orders pinned here are
theirs.
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
