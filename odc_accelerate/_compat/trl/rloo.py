"""TRL's RLOOTrainer internals that odc_accelerate reads or patches, checked against the installed version.

RLOOTrainer (TRL 1.16) generates and scores like GRPOTrainer, its advantages computed over the gathered global batch.
Pinned here: its batch keys (one ``old_logps`` and one ``advantages`` per completion), its loss normalisation
(`RLOO_LOSS_NORMALISATION`, a sequence-level PPO clip averaged over the microbatch's sequences), its per-microbatch
metric calls (`rloo_metric_calls`) and its reference preparer (`rloo_reference_preparer`). Its vLLM generation and
``RepeatSampler`` are GRPO's, used through `odc_accelerate._compat.trl.grpo`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .. import CompatError, installed_version, require, version_tuple, warn_if_untested
from . import _LIBRARY, _reference_preparer

#: The first TRL release the RLOO integration was tested with (its batch keys, loss and metric calls).
_RLOO_MIN_TRL = (1, 16)

#: Keys of RLOOTrainer._generate_and_score_completions' output that the ODC trainer re-batches: one value per
#: completion token (right-padded with the given value; None: the tokenizer's pad token id), one per completion, and
#: the left-padded prompt.
RLOO_TOKEN_KEYS = {"completion_ids": None, "completion_mask": 0}
RLOO_SAMPLE_KEYS = ("old_logps", "advantages")
RLOO_PROMPT_KEYS = ("prompt_ids", "prompt_mask")

#: How RLOOTrainer._compute_loss normalises a microbatch's loss: ``per_sequence_loss.mean()``, a mean over its
#: sequences (the same kind as GRPO's "sequences", see `odc_accelerate._compat.trl.grpo.GRPO_LOSS_NORMALISATION`).
RLOO_LOSS_NORMALISATION = "sequences"

# The methods the ODC RLOO trainer overrides or calls, and the attributes it reads.
_METHODS = (
    "_generate_and_score_completions",
    "_generate",
    "_compute_loss",
    "_get_train_sampler",
    "_get_per_token_logps_and_entropies",
)
_ATTRIBUTES = (
    "_metrics",
    "beta",
    "num_generations",
    "ref_model",
    "aux_loss_enabled",
    "use_vllm",
    "normalize_advantages",
)


def check_rloo(trainer: Any) -> None:
    """Raise `~odc_accelerate._compat.CompatError` if RLOOTrainer lacks an internal the ODC trainer reads or wraps."""
    detail = (
        "odc_accelerate re-batches RLOO completions (prompt / completion ids and masks, old_logps, advantages) and "
        "rescales its loss as a mean over sequences, as the tested versions compute it; if TRL changed either, the "
        "ODC loss may differ from TRL's."
    )
    warn_if_untested(_LIBRARY, detail)
    installed = installed_version(_LIBRARY)
    if version_tuple(installed) < _RLOO_MIN_TRL:
        wanted = ".".join(map(str, _RLOO_MIN_TRL))
        raise CompatError(
            f"ODCRLOOTrainer is tested with TRL {wanted} and later; TRL {installed} is installed. Upgrade TRL "
            f"(pip install 'trl>={wanted}') for RLOO with ODC (SFT and DPO also run on this TRL)."
        )
    from trl import RLOOTrainer

    where = "trl.RLOOTrainer"
    for attr in _METHODS:
        require(RLOOTrainer, attr, library=_LIBRARY, where=where)
    for attr in _ATTRIBUTES:
        require(trainer, attr, library=_LIBRARY, where=where)


@contextlib.contextmanager
def rloo_reference_preparer(prepare: Any) -> Iterator[None]:
    """`odc_accelerate._compat.trl.dpo.dpo_reference_preparer` for RLOOTrainer (its reference model, used with
    ``beta > 0``)."""
    from trl.trainer import rloo_trainer

    with _reference_preparer(rloo_trainer, "trl.trainer.rloo_trainer", prepare):
        yield


def rloo_metric_calls(trainer: Any) -> tuple[tuple[tuple[str, str], ...], ...]:
    """The ``accelerator.gather`` / ``reduce`` calls RLOOTrainer._compute_loss makes per training microbatch, in call
    order; for each, the metrics TRL records from it as (name, how the step's value is formed: "ratio" of summed
    values over their count, "min" or "max").

    The entropy is a ``reduce`` of a ``[sum, count]`` pair; each clip indicator is a gather of one value per sequence
    (``is_low_clipped`` feeds both ``clip_ratio/low_mean`` and ``clip_ratio/low_min``). With a MoE router's auxiliary
    loss a ``gather_for_metrics`` of it comes first: under an ODC plan each microbatch's value is weighted by its share
    of the step's routed tokens, the step's value their "sum".
    """
    calls: list[tuple[tuple[str, str], ...]] = []
    if getattr(trainer, "aux_loss_enabled", False):
        calls.append((("aux_loss", "sum"),))
    calls += [
        (("entropy", "ratio"),),
        (("clip_ratio/low_mean", "ratio"), ("clip_ratio/low_min", "min")),
        (("clip_ratio/high_mean", "ratio"), ("clip_ratio/high_max", "max")),
        (("clip_ratio/region_mean", "ratio"),),
    ]
    return tuple(calls)
