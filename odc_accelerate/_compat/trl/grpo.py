"""TRL's GRPOTrainer: its completions' keys, how it normalises each loss type, the metric calls it makes per
microbatch, its reference model under FSDP, and its vLLM generation in colocate mode (the weight sync and generation
hooks).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from .. import (
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
from . import _LIBRARY, _reference_preparer

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


def pad_token_id(trainer: Any) -> int:
    """The pad token id the online trainers (GRPO, RLOO, distillation) pad completions with (their ``_tokenizer``)."""
    tokenizer = require(trainer, "_tokenizer", library=_LIBRARY, where=type(trainer).__name__)
    return int(tokenizer.pad_token_id)


def grpo_metric_calls(trainer: Any) -> tuple[tuple[str, str], ...]:
    """The ``accelerator.reduce`` / ``gather`` calls GRPOTrainer._compute_loss makes per training microbatch, in call
    order, as (metric name, how the step's value is formed: "ratio" of summed pairs, "min" or "max", "sum" of the
    values). With a MoE router's auxiliary loss a ``gather_for_metrics`` of it comes first: under an ODC plan each
    microbatch's value is weighted by its share of the step's routed tokens, the step's value their sum."""
    calls: list[tuple[str, str]] = []
    if getattr(trainer, "aux_loss_enabled", False):
        calls.append(("aux_loss", "sum"))
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


def grpo_sample_per_step(sampler: Any, steps: int) -> Any:
    """Make GRPO's (and RLOO's) ``RepeatSampler`` yield each generation batch ``steps`` times (the optimizer steps it
    feeds: ``num_iterations x steps_per_generation / gradient_accumulation_steps``) instead of TRL's
    ``num_iterations x steps_per_generation`` (one per accumulation step): under a balanced ODC plan one loader item is
    one optimizer step (the Trainer runs one accumulation step), and the items of the steps that reuse a generation
    batch are read and set aside, as TRL sets aside its repeats."""
    require(sampler, "repeat_count", library=_LIBRARY, where="trl.trainer.utils.RepeatSampler")
    sampler.repeat_count = int(steps)
    return sampler


def shuffle_generation_batch(batch: dict[str, Any], trainer_module: str) -> dict[str, Any]:
    """TRL's shuffle of a rank's generation batch before it is split into ``steps_per_generation`` slices: the
    ``shuffle_sequence_dict`` that ``trainer_module`` (``trl.trainer.grpo_trainer``, ``trl.trainer.rloo_trainer``)
    calls in its ``_prepare_inputs``, looked up when called (the same permutation of the rank's torch RNG as TRL's)."""
    shuffle = import_attr(trainer_module, "shuffle_sequence_dict", library=_LIBRARY)
    return shuffle(batch)


@contextlib.contextmanager
def grpo_reference_preparer(prepare: Any) -> Iterator[None]:
    """`dpo_reference_preparer` for GRPOTrainer (its reference model, used with ``beta > 0``)."""
    from trl.trainer import grpo_trainer

    with _reference_preparer(grpo_trainer, "trl.trainer.grpo_trainer", prepare):
        yield


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
_VLLM_GENERATION_ATTRS = ("mode", "enable_sleep_mode", "sync_weights", "generate")


def grpo_vllm_generation(trainer: Any) -> Any:
    """The trainer's `trl.generation.vllm_generation.VLLMGeneration` (``use_vllm=True``), checked for what the ODC
    trainer reads (``mode``, ``enable_sleep_mode``, ``sync_weights``, ``generate``, and in colocate mode its engine
    ``llm``)."""
    where = "trl.generation.vllm_generation.VLLMGeneration"
    generation = require(trainer, "vllm_generation", library=_LIBRARY, where="trl.GRPOTrainer")
    for attr in _VLLM_GENERATION_ATTRS:
        require(generation, attr, library=_LIBRARY, where=where)
    if generation.mode == "colocate":
        require(generation, "llm", library=_LIBRARY, where=where)
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


# ------------------------------------------------------------------------------------------ GRPO with vLLM (server)
# In server mode TRL's ``VLLMGeneration._init_vllm`` creates, on the main process only, ``vllm_client`` (a
# `trl.generation.vllm_client.VLLMClient`: ``session``, ``base_url``, ``weight_update()``, ``update_named_params``,
# ``reset_prefix_cache``, ``get_server_info``) and calls its ``init_communicator(device=accelerator.device)``, which joins
# the server's NCCL weight-transfer engine and raises NotImplementedError on any device but CUDA. ``generate`` gathers
# every rank's prompts and images (two ``gather_object``) and broadcasts the completions from the main process
# (``broadcast_object_list``): collectives made once per generation call, by every rank. ``sync_weights`` gathers every
# parameter with ``full_tensor()`` on every rank and streams it from the main process; under ODC it is replaced.
_VLLM_CLIENT_MODULE = "trl.generation.vllm_client"
_VLLM_CLIENT_ATTRS = ("session", "base_url", "weight_update", "update_named_params", "reset_prefix_cache")


def grpo_vllm_client(generation: Any) -> Any:
    """TRL's client of the vLLM server (server mode, main process), checked for what ODC's sync uses."""
    where = "trl.generation.vllm_client.VLLMClient"
    client = require(
        generation, "vllm_client", library=_LIBRARY, where="trl.generation.vllm_generation.VLLMGeneration"
    )
    for attr in _VLLM_CLIENT_ATTRS:
        require(client, attr, library=_LIBRARY, where=where)
    return client


def vllm_client_weight_update(client: Any) -> Any:
    """TRL's ``client.weight_update()``: the server prepares its model once for the updates inside."""
    return client.weight_update()


@contextlib.contextmanager
def vllm_server_without_communicator(skip: Any) -> Iterator[None]:
    """While TRL's ``__init__`` runs: where ``skip(device)`` is true, ``VLLMClient.init_communicator`` checks that the
    server exposes vLLM's development endpoints (its ``/server_info``, as TRL's does first) instead of joining an
    NCCL weight-transfer group, which needs CUDA: ODC's sync without CUDA reloads the server from files
    (`odc_accelerate.integrations.vllm_server`). Elsewhere TRL's own ``init_communicator`` runs."""
    client_class = import_attr(_VLLM_CLIENT_MODULE, "VLLMClient", library=_LIBRARY)
    where = f"{_VLLM_CLIENT_MODULE}.VLLMClient"

    def replace(original: Any) -> Any:
        @functools.wraps(original)
        def init_communicator(self: Any, device: Any = 0) -> None:
            if not skip(device):
                return original(self, device)
            # checked here, in server mode only: a run without it (colocate, no vLLM) needs nothing of the client
            get_server_info = require(self, "get_server_info", library=_LIBRARY, where=where)
            get_server_info()  # raises, naming VLLM_SERVER_DEV_MODE=1, where the server lacks dev endpoints
            return None

        return init_communicator

    with patched_attribute(client_class, "init_communicator", replace, library=_LIBRARY, where=where):
        yield
