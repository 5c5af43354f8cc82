"""Every TRL internal that odc_accelerate reads or patches, in one place, checked against the installed version.

SFT and DPO: the order and meaning of the metric gathers each trainer makes per microbatch, and the attributes they
feed; SFT also: ``SFTTrainer._prepare_dataset`` (padding-free data with ``max_length``); DPO also: the module-level
``prepare_fsdp`` name DPOTrainer uses for its reference model; both, on TRL 1.15: the fused LM head's kernel
(``add_fused_lm_head``, ``_ChunkedLogProbFunction``), given a torch path on CPU. The patches last for a ``with`` block
only.

TRL's ``SFTTrainer.compute_loss`` calls ``accelerator.gather_for_metrics`` several times per microbatch and folds the
results into ``self._metrics`` and ``self._total_train_tokens``. The ODC trainer answers those gathers locally during
the microbatches and fixes the recorded values at the step boundary; that needs the ORDER of the gathers and the
names of the attributes they feed, which are private to TRL and pinned here.

The tested TRL versions are ``TESTED["trl"]`` in :mod:`odc_accelerate._compat`; the gather orders below are theirs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Iterator
from typing import Any

from ..log_probs import torch_log_probs
from . import (
    CompatError,
    check_signature,
    import_attr,
    installed_version,
    patch_attribute,
    patched_attribute,
    require,
    version_tuple,
    warn_if_untested,
)

_LIBRARY = "trl"

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


# ------------------------------------------------------------------------------------------ fused LM head (TRL 1.15)
# TRL's SFT, DPO and GRPO trainers give their models a fused LM head (``trl.trainer.utils.add_fused_lm_head``): a
# forward with ``fused_lm_head=True`` scores the labels through ``trl.trainer.utils._ChunkedLogProbFunction`` without
# building the logits. In TRL 1.15 that function always runs a Triton kernel (a CPU tensor fails inside Triton) and is
# None where Triton is missing; TRL 1.16 folds the tiles in torch on devices without Triton. Before 1.16 the trainers
# built inside `fused_lm_head_torch_path` get a torch path from here.
_TRL_WITH_TORCH_LM_HEAD = (1, 16)
_TRITON_DEVICES = ("cuda", "xpu")
_FUSED_LM_HEAD_TRAINERS = {
    "sft": "trl.trainer.sft_trainer",
    "dpo": "trl.trainer.dpo_trainer",
    "grpo": "trl.trainer.grpo_trainer",
}
# What TRL 1.15's fused forward passes to `_ChunkedLogProbFunction.apply`, positionally, in this order.
_LOG_PROB_ARGS = (
    "hidden",
    "weight",
    "bias",
    "targets",
    "temperature",
    "chunk_size",
    "final_logit_softcapping",
    "logit_scale",
    "outputs",
)


def needs_torch_lm_head() -> bool:
    """Whether the installed TRL's fused LM head lacks a path for devices without Triton (TRL before 1.16)."""
    return version_tuple(installed_version(_LIBRARY)) < _TRL_WITH_TORCH_LM_HEAD


@contextlib.contextmanager
def fused_lm_head_torch_path(trainer: str) -> Iterator[None]:
    """Within the block (the ``__init__`` of TRL's SFT, DPO or GRPO trainer), the fused LM head that TRL puts on the
    models also runs on devices without Triton (CPU).

    On TRL 1.16 and later (which has that path itself) the block changes nothing. On TRL 1.15 the forward TRL installs
    on each model (policy and reference) is wrapped: a ``fused_lm_head=True`` call scores the labels with TRL's kernel
    on CUDA / XPU and with `odc_accelerate.log_probs.torch_log_probs` elsewhere. The wrapper belongs to the model
    instance; TRL's module is patched for the block only (``add_fused_lm_head``) and for the duration of each fused
    call (``_ChunkedLogProbFunction``).

    Args:
        trainer (`str`): ``"sft"``, ``"dpo"`` or ``"grpo"``, the trainer whose ``__init__`` runs in the block.
    """
    if trainer not in _FUSED_LM_HEAD_TRAINERS:
        raise ValueError(f"trainer must be one of {sorted(_FUSED_LM_HEAD_TRAINERS)}, not {trainer!r}")
    if not needs_torch_lm_head():
        yield
        return
    import importlib

    from trl.trainer import utils as trl_utils

    module = importlib.import_module(_FUSED_LM_HEAD_TRAINERS[trainer])
    where = module.__name__
    current = require(module, "add_fused_lm_head", library=_LIBRARY, where=where)
    check_signature(current, ("model",), library=_LIBRARY, where=f"{where}.add_fused_lm_head")
    kernel = require(trl_utils, "_ChunkedLogProbFunction", library=_LIBRARY, where="trl.trainer.utils")
    if kernel is not None:  # None: TRL found no Triton, and every fused call takes the torch path
        check_signature(
            kernel.forward, _LOG_PROB_ARGS, library=_LIBRARY, where="trl.trainer.utils._ChunkedLogProbFunction.forward"
        )

    def wrap(original: Any) -> Any:
        @functools.wraps(original)
        def add_fused_lm_head(model: Any, *args: Any, **kwargs: Any) -> None:
            original(model, *args, **kwargs)
            _route_fused_calls(model, trl_utils)

        return add_fused_lm_head

    with patched_attribute(module, "add_fused_lm_head", wrap, library=_LIBRARY, where=where):
        yield


def _route_fused_calls(model: Any, trl_utils: Any) -> None:
    """Wrap the fused forward TRL just bound to ``model``: fused calls see `_log_prob_function` as TRL's kernel."""
    fused = model.forward  # TRL's `_fused_forward`, bound to the model

    @functools.wraps(getattr(fused, "__func__", fused))  # keeps the model's signature (`generate` validates it)
    def forward(self: Any, *args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if not fused_lm_head:
            return fused(*args, **kwargs)
        with patched_attribute(
            trl_utils,
            "_ChunkedLogProbFunction",
            _log_prob_function,
            library=_LIBRARY,
            where="trl.trainer.utils",
        ):
            return fused(*args, fused_lm_head=True, **kwargs)

    model.forward = types.MethodType(forward, model)


def _log_prob_function(kernel: Any) -> Any:
    class _ChunkedLogProbs:
        """TRL's ``_ChunkedLogProbFunction`` on CUDA / XPU, `torch_log_probs` elsewhere (or without Triton)."""

        @staticmethod
        def apply(*args: Any) -> Any:
            if kernel is not None and args[0].device.type in _TRITON_DEVICES:
                return kernel.apply(*args)
            return torch_log_probs(*args)

    return _ChunkedLogProbs


# ----------------------------------------------------------------------------------------------------------- DPO
# What DPOTrainer._compute_loss passes to accelerator.gather / gather_for_metrics per training microbatch, in call
# order. An "aux_loss" gather comes first when the model's router aux loss is on.
DPO_TRAIN_GATHERS = (
    "entropy_sum",
    "entropy_tokens",
    "num_tokens",
    "chosen_logits_sum",
    "chosen_tokens",
    "rejected_logits_sum",
    "rejected_tokens",
    "correct_tokens",
    "accuracy_tokens",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)

# Metrics that DPOTrainer appends once per microbatch (the ODC trainer replaces them with one value per step).
DPO_PER_MICROBATCH = (
    "aux_loss",
    "entropy",
    "logits/chosen",
    "logits/rejected",
    "mean_token_accuracy",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def dpo_gathers(trainer: Any) -> tuple[str, ...]:
    return (("aux_loss",) if getattr(trainer, "aux_loss_enabled", False) else ()) + DPO_TRAIN_GATHERS


def check_dpo(trainer: Any) -> None:
    """Raise `~odc_accelerate._compat.CompatError` if the DPO trainer lacks an internal the ODC trainer reads or
    rewrites."""
    detail = (
        "odc_accelerate reads the DPO metric gathers in the order of the tested versions; if TRL changed them, the "
        "logged DPO metrics may be wrong (the loss and training are unaffected)."
    )
    warn_if_untested(_LIBRARY, detail)
    for attr in (
        "_metrics",
        "_total_train_tokens",
        "aux_loss_enabled",
        "precompute_ref_logps",
        "loss_types",
        "ref_model",
    ):
        require(trainer, attr, library=_LIBRARY, where="trl.DPOTrainer")


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


@contextlib.contextmanager
def dpo_reference_preparer(prepare: Any) -> Iterator[None]:
    """Within the block, DPOTrainer prepares its reference model under FSDP with ``prepare(model, accelerator,
    trl_prepare)`` instead of TRL's ``prepare_fsdp`` (which shards the root only, so every reference forward is one
    whole-model all-gather). ``trl_prepare(model, accelerator)`` is TRL's own, for the cases ``prepare`` leaves to it.
    """
    from trl.trainer import dpo_trainer

    with _reference_preparer(dpo_trainer, "trl.trainer.dpo_trainer", prepare):
        yield


@contextlib.contextmanager
def grpo_reference_preparer(prepare: Any) -> Iterator[None]:
    """`dpo_reference_preparer` for GRPOTrainer (its reference model, used with ``beta > 0``)."""
    from trl.trainer import grpo_trainer

    with _reference_preparer(grpo_trainer, "trl.trainer.grpo_trainer", prepare):
        yield


@contextlib.contextmanager
def _reference_preparer(module: Any, where: str, prepare: Any) -> Iterator[None]:
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


# ---------------------------------------------------------------------------------------------------------- GRPO
# How GRPOTrainer._compute_loss normalises each loss type over one microbatch, and therefore what a microbatch's loss
# is multiplied by so that the step's gradient is that of one process over the whole global batch:
#   "sequences": a mean over the microbatch's sequences (of per-sequence token means for grpo / sapo, of per-sequence
#                sums for luspo, of sums over max_completion_length for dr_grpo) -> x rows x world / all sequences;
#   "tokens":    a mean over the microbatch's loss tokens (bnpo) -> x its tokens x world / all loss tokens;
#   "global":    a sum over tokens divided by num_items_in_batch / world x grad-accumulation / steps_per_generation
#                (dapo, cispo, vespo) -> x that normaliser x world / all loss tokens.
GRPO_LOSS_NORMALISATION = {
    "grpo": "sequences",
    "sapo": "sequences",
    "luspo": "sequences",
    "dr_grpo": "sequences",
    "bnpo": "tokens",
    "dapo": "global",
    "cispo": "global",
    "vespo": "global",
}

# Keys of GRPOTrainer._generate_and_score_completions' output that the ODC trainer re-batches: one value per
# completion token (right-padded with the given value), or one per completion.
GRPO_TOKEN_KEYS = {
    "completion_ids": None,  # the tokenizer's pad token id
    "completion_mask": 0,
    "tool_mask": 1,
    "old_per_token_logps": 0.0,
    "ref_per_token_logps": 0.0,
    "sampling_per_token_logps": 0.0,
}
GRPO_SAMPLE_KEYS = ("advantages",)
# Keys with one value per completion token or one per completion, depending on the trainer's settings: TRL's
# ``importance_sampling_ratio`` (vLLM's importance-sampling correction) is ``(B, T)`` in the ``token_*`` modes of
# ``vllm_importance_sampling_mode`` and ``(B, 1)`` in the ``sequence_*`` modes. Right-padded with the given value in
# the token modes: 1.0, the ratio TRL itself computes beyond a completion's mask.
GRPO_TOKEN_OR_SEQUENCE_KEYS = {"importance_sampling_ratio": 1.0}
GRPO_SEQUENCE_IS_MODES = ("sequence_mask", "sequence_truncate")
# The first TRL release the GRPO integration was tested with (its completions' keys and loss normalisations).
_GRPO_MIN_TRL = (1, 16)
GRPO_PROMPT_KEYS = ("prompt_ids", "prompt_mask")


def check_grpo(trainer: Any) -> None:
    """Raise `~odc_accelerate._compat.CompatError` if GRPOTrainer lacks an internal the ODC trainer reads or wraps."""
    detail = (
        "odc_accelerate re-batches GRPO completions and rescales each loss type as the tested versions normalise "
        "them; if TRL changed either, the ODC loss may differ from TRL's."
    )
    warn_if_untested(_LIBRARY, detail)
    installed = installed_version(_LIBRARY)
    if version_tuple(installed) < _GRPO_MIN_TRL:
        raise CompatError(
            f"ODCGRPOTrainer is tested with TRL {'.'.join(map(str, _GRPO_MIN_TRL))} and later; TRL {installed} is "
            f"installed. Upgrade TRL (pip install 'trl>={'.'.join(map(str, _GRPO_MIN_TRL))}') for GRPO with ODC "
            "(SFT and DPO also run on this TRL)."
        )
    from trl import GRPOTrainer

    where = "trl.GRPOTrainer"
    for attr in ("_generate_and_score_completions", "_generate", "_compute_loss", "_get_train_sampler"):
        require(GRPOTrainer, attr, library=_LIBRARY, where=where)
    for attr in ("_metrics", "loss_type", "beta", "num_generations", "ref_model", "aux_loss_enabled", "use_vllm"):
        require(trainer, attr, library=_LIBRARY, where=where)


def generate_and_score_completions(trainer: Any, inputs: list[dict[str, Any]]) -> dict[str, Any]:
    """Generate and score the completions of ``inputs`` (a batch of prompts) as TRL does: GRPOTrainer's
    ``_generate_and_score_completions``, which :func:`check_grpo` checks."""
    method = require(trainer, "_generate_and_score_completions", library=_LIBRARY, where=type(trainer).__name__)
    return method(inputs)


def grpo_metric_calls(trainer: Any) -> tuple[tuple[str, str], ...]:
    """The ``accelerator.reduce`` / ``gather`` calls GRPOTrainer._compute_loss makes per training microbatch, in call
    order, as (metric name, how the step's value is formed: "ratio" of summed pairs, "min" or "max")."""
    calls: list[tuple[str, str]] = []
    if trainer.beta != 0.0:
        calls.append(("kl", "ratio"))
    calls.append(("entropy", "ratio"))
    if trainer.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        calls += [
            ("clip_ratio/low_mean", "ratio"),
            ("clip_ratio/high_mean", "ratio"),
            ("clip_ratio/region_mean", "ratio"),
            ("clip_ratio/low_min", "min"),
            ("clip_ratio/high_max", "max"),
        ]
    elif trainer.loss_type == "cispo":
        calls.append(("cispo_clip_ratio", "ratio"))
    elif trainer.loss_type == "vespo":
        calls.append(("vespo/phi_seq_mean", "ratio"))
    return tuple(calls)


def grpo_sample_each_step_once(sampler: Any, num_iterations: int) -> Any:
    """Make GRPO's ``RepeatSampler`` yield each generation batch ``num_iterations`` times instead of
    ``num_iterations x steps_per_generation`` times: under a balanced ODC plan one optimizer step consumes a whole
    generation batch (the Trainer runs one accumulation step), so TRL's repeats for its accumulation steps would train
    the same prompts again."""
    require(sampler, "repeat_count", library=_LIBRARY, where="trl.trainer.utils.RepeatSampler")
    sampler.repeat_count = int(num_iterations)
    return sampler


# ---------------------------------------------------------------------------------------- GRPO with vLLM (colocate)
# TRL 1.16 keeps its vLLM engine in a `trl.generation.vllm_generation.VLLMGeneration`, ``trainer.vllm_generation``,
# built in GRPOTrainer.__init__. In colocate mode its ``_init_vllm`` creates each rank's `vllm.LLM` (``.llm``, with
# ``distributed_executor_backend="external_launcher"``: the engine core runs in the rank's own process); TRL's
# ``_generate_single_turn`` (and ``_generate`` before a ``rollout_func``) calls ``sync_weights()`` when
# ``trainer.state.global_step`` moved past ``trainer._last_loaded_step``, then ``generate(prompts=..., images=...,
# num_generations=..., profiler=...)``; ``generate`` itself calls ``sync_weights()`` again when sleep mode discarded
# the weights (``_llm_weights_sleeping``). TRL's ``sync_weights`` first wakes the weights up under sleep mode
# (``empty_cache()`` of that module, then ``llm.wake_up(tags=["weights"])``), loads every parameter with the vLLM
# model's ``load_weights`` (after FSDP2's ``full_tensor()``, a collective per parameter) and ends with
# ``llm.reset_prefix_cache()``.
_VLLM_GENERATION_MODULE = "trl.generation.vllm_generation"
_VLLM_GENERATION_ATTRS = ("llm", "mode", "enable_sleep_mode", "sync_weights", "generate")


def grpo_vllm_generation(trainer: Any) -> Any:
    """The trainer's `trl.generation.vllm_generation.VLLMGeneration` (``use_vllm=True``), checked for what the ODC
    trainer reads (its colocated engine ``llm``, ``mode``, ``enable_sleep_mode``, ``sync_weights``, ``generate``)."""
    where = "trl.generation.vllm_generation.VLLMGeneration"
    generation = require(trainer, "vllm_generation", library=_LIBRARY, where="trl.GRPOTrainer")
    for attr in _VLLM_GENERATION_ATTRS:
        require(generation, attr, library=_LIBRARY, where=where)
    check_signature(
        type(generation).generate,
        ("prompts", "images", "num_generations", "profiler"),
        library=_LIBRARY,
        where=f"{where}.generate",
    )
    return generation


def grpo_vllm_engine(generation: Any) -> Any:
    """The colocated `vllm.LLM` of a `VLLMGeneration` (this rank's engine)."""
    return require(generation, "llm", library=_LIBRARY, where="trl.generation.vllm_generation.VLLMGeneration")


def grpo_vllm_hooks(trainer: Any, sync: Any | None, around: Any) -> None:
    """On this trainer's `VLLMGeneration` instance only: ``sync_weights()`` becomes ``sync()`` (TRL's callers, the
    trainer's generation and ``generate`` under sleep mode, call it where TRL syncs), and each ``generate`` call runs
    inside ``around()`` (the trainer's timing). With ``sync=None`` TRL's own ``sync_weights`` stays and runs inside
    ``around()`` too (plain FSDP2: its sync and generation timed as ODC's are).

    Raises:
        CompatError: TRL's GRPO has no `VLLMGeneration` or it lacks what is replaced.
    """
    generation = grpo_vllm_generation(trainer)
    where = "trl.generation.vllm_generation.VLLMGeneration"

    def replace_sync(original: Any) -> Any:
        @functools.wraps(original)
        def sync_weights() -> None:
            if sync is not None:
                sync()
                return
            with around():
                original()

        return sync_weights

    def wrap_generate(original: Any) -> Any:
        @functools.wraps(original)
        def generate(*args: Any, **kwargs: Any) -> Any:
            with around():
                return original(*args, **kwargs)

        return generate

    patch_attribute(generation, "sync_weights", replace_sync, library=_LIBRARY, where=where)
    patch_attribute(generation, "generate", wrap_generate, library=_LIBRARY, where=where)


def wake_vllm_weights(generation: Any) -> None:
    """What TRL's ``VLLMGeneration.sync_weights`` does before loading, in colocate mode with sleep mode: free the
    device cache and wake the engine's weights up (sleep level 2 discarded them)."""
    if getattr(generation, "mode", None) != "colocate" or not generation.enable_sleep_mode:
        return
    empty_cache = import_attr(_VLLM_GENERATION_MODULE, "empty_cache", library=_LIBRARY)
    empty_cache()
    grpo_vllm_engine(generation).wake_up(tags=["weights"])
    generation._llm_weights_sleeping = False


def reset_vllm_prefix_cache(generation: Any) -> None:
    """What TRL's ``VLLMGeneration.sync_weights`` does after loading: drop the prefix cache computed with the old
    weights."""
    grpo_vllm_engine(generation).reset_prefix_cache()


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


# ------------------------------------------------------------------------------ public names (odc_accelerate.cli)
#: The classes `replace_public_classes` may replace, and the modules a script imports them from: ``from trl import
#: SFTTrainer`` and ``from trl.trainer import SFTTrainer``. The modules that define them (``trl.trainer.sft_trainer``,
#: ...) keep TRL's classes, so TRL's own code and the TRL trainers defined on top of them (GKD, GOLD, ...) are
#: unchanged.
PUBLIC_CLASSES = (
    "SFTConfig",
    "SFTTrainer",
    "DPOConfig",
    "DPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "RLOOConfig",
    "RLOOTrainer",
)
PUBLIC_MODULES = ("trl", "trl.trainer")
_REPLACED: dict[tuple[str, str], Any] = {}


def replace_public_classes(replacements: dict[str, type]) -> None:
    """Make the names of `PUBLIC_CLASSES` in `PUBLIC_MODULES` return the given subclasses (`restore_public_classes`
    undoes it).

    Args:
        replacements (`dict[str, type]`): TRL class name -> its replacement, a subclass of TRL's class.

    Raises:
        ValueError: a name outside `PUBLIC_CLASSES`.
        TypeError: a replacement that does not subclass the TRL class it replaces.
    """
    import importlib

    unknown = set(replacements) - set(PUBLIC_CLASSES)
    if unknown:
        raise ValueError(f"Only {', '.join(PUBLIC_CLASSES)} can be replaced, not {', '.join(sorted(unknown))}.")
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name, cls in replacements.items():
            original = _REPLACED.get((module_name, name))
            if original is None:
                original = require(module, name, library=_LIBRARY, where=module_name)
            if not (isinstance(cls, type) and issubclass(cls, original)):
                raise TypeError(f"{module_name}.{name} can only be replaced by a subclass of it, not {cls!r}.")
            _REPLACED.setdefault((module_name, name), original)
            setattr(module, name, cls)


def restore_public_classes() -> None:
    """Give back TRL's classes replaced by `replace_public_classes`."""
    import sys

    for (module_name, name), original in _REPLACED.items():
        setattr(sys.modules[module_name], name, original)
    _REPLACED.clear()
