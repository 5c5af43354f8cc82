"""TRL's DistillationTrainer internals that odc_accelerate reads or patches, checked against the installed version.

DistillationTrainer (TRL 1.16) generates on-policy like GRPOTrainer (``_generate``, ``_generate_and_score_completions``,
``RepeatSampler``, ``VLLMGeneration``), one completion per prompt. Pinned here: its generation batch's keys, its loss
normaliser (a sum over completion tokens divided by ``num_items_in_batch / world``), its two metric gathers per
microbatch (`DISTILLATION_TRAIN_GATHERS`), how it prepares its teacher (``accelerator.prepare_model(teacher,
evaluation_mode=True)`` after the Trainer's set-up: `teacher_preparer`). Its loader reads ``per_device_train_batch_size
x gradient_accumulation_steps`` prompts per rank, generated once and split into the accumulation's microbatches.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from .. import (
    CompatError,
    check_signature,
    installed_version,
    patched_attribute,
    require,
    version_tuple,
    warn_if_untested,
)
from .. import accelerate as accelerate_compat
from . import _LIBRARY

__all__ = [
    "DISTILLATION_PROMPT_KEYS",
    "DISTILLATION_TOKEN_KEYS",
    "DISTILLATION_TRAIN_GATHERS",
    "check_distillation",
    "checked_heads",
    "teacher_preparer",
]

#: The first TRL release the distillation integration was tested with (on-policy generation, chunked JSD loss).
_DISTILLATION_MIN_TRL = (1, 16)

#: Keys of DistillationTrainer._generate_and_score_completions' output that the ODC trainer re-batches (text only):
#: one value per completion token, right-padded with the given value (None: the tokenizer's pad token id), and the
#: left-padded prompt. There is no per-completion value.
DISTILLATION_TOKEN_KEYS = {"completion_ids": None, "completion_mask": 0, "tool_mask": 1}
DISTILLATION_PROMPT_KEYS = ("prompt_ids", "prompt_mask")

#: What DistillationTrainer.compute_loss passes to ``accelerator.gather_for_metrics`` per microbatch, in call order:
#: the microbatch's loss tokens, then the sum of the student's per-token entropy over them; it logs their ratio as
#: ``entropy``.
DISTILLATION_TRAIN_GATHERS = ("num_valid_tokens", "entropy_sum")

_METHODS = (
    "_generate_and_score_completions",
    "_generate",
    "_generate_single_turn",
    "_compute_loss",
    "_get_last_hidden_state",
    "_get_train_sampler",
    "get_train_dataloader",
)
_ATTRIBUTES = ("_metrics", "teacher_model", "beta", "temperature", "use_vllm", "max_completion_length")


def check_distillation(trainer: Any) -> None:
    """Raise `~odc_accelerate._compat.CompatError` if DistillationTrainer lacks an internal the ODC trainer reads or
    wraps."""
    detail = (
        "odc_accelerate re-batches distillation completions (prompt / completion ids and masks) and reads the "
        f"trainer's metric gathers ({', '.join(DISTILLATION_TRAIN_GATHERS)}) as the tested versions make them; if TRL "
        "changed either, the ODC loss or the logged entropy may differ from TRL's."
    )
    warn_if_untested(_LIBRARY, detail)
    installed = installed_version(_LIBRARY)
    if version_tuple(installed) < _DISTILLATION_MIN_TRL:
        wanted = ".".join(map(str, _DISTILLATION_MIN_TRL))
        raise CompatError(
            f"ODCDistillationTrainer is tested with TRL {wanted} and later; TRL {installed} is installed. Upgrade TRL "
            f"(pip install 'trl>={wanted}') for distillation with ODC."
        )
    from trl import DistillationTrainer

    where = "trl.DistillationTrainer"
    for attr in _METHODS:
        require(DistillationTrainer, attr, library=_LIBRARY, where=where)
    for attr in _ATTRIBUTES:
        require(trainer, attr, library=_LIBRARY, where=where)


@contextlib.contextmanager
def teacher_preparer(prepare: Any) -> Iterator[None]:
    """Within the block (DistillationTrainer's ``__init__``), the teacher is prepared with ``prepare(model,
    accelerator, trl_prepare)`` instead of ``accelerator.prepare_model(teacher, evaluation_mode=True)``, which
    ``trl_prepare(model, accelerator)`` still does. TRL prepares nothing else for evaluation there."""
    with accelerate_compat.evaluation_models_prepared_by(prepare):
        yield


#: The leading parameters of TRL's ``_chunked_divergence_loss`` (the function of ``trl.trainer.distillation_trainer``
#: that ``_compute_loss`` calls with both models' hidden states and ``lm_head`` weights).
_LOSS_ARGS = ("student_hidden_states", "teacher_hidden_states", "student_lm_head_weight", "teacher_lm_head_weight")


@contextlib.contextmanager
def checked_heads(check: Callable[[Any, Any], None]) -> Iterator[None]:
    """Within the block, TRL's distillation loss calls ``check(student_lm_head_weight, teacher_lm_head_weight)``
    before it reads the weights (where TRL would ``full_tensor()`` a sharded one)."""
    from trl.trainer import distillation_trainer

    where = "trl.trainer.distillation_trainer"
    current = require(distillation_trainer, "_chunked_divergence_loss", library=_LIBRARY, where=where)
    check_signature(current, _LOSS_ARGS, library=_LIBRARY, where=f"{where}._chunked_divergence_loss")

    def wrap(original: Any) -> Any:
        @functools.wraps(original)
        def chunked_divergence_loss(
            student_hidden_states: Any,
            teacher_hidden_states: Any,
            student_lm_head_weight: Any,
            teacher_lm_head_weight: Any,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            check(student_lm_head_weight, teacher_lm_head_weight)
            return original(
                student_hidden_states, teacher_hidden_states, student_lm_head_weight, teacher_lm_head_weight, *args,
                **kwargs,
            )  # fmt: skip

        return chunked_divergence_loss

    with patched_attribute(distillation_trainer, "_chunked_divergence_loss", wrap, library=_LIBRARY, where=where):
        yield
