"""What ODC refuses of an online (GRPO, RLOO) run, before any work: GRPO's loss types and options whose loss cannot be
made exact under a plan (`check_grpo_args`), the vLLM settings ODC's per-rank weight sync cannot serve
(`check_vllm_args`), a model that sync would get wrong (`check_vllm_sync_settings`), and an optimizer step that would
take more than one generation batch (`check_generation_steps`)."""

from __future__ import annotations

from typing import Any

from ..._compat.trl import grpo as trl_grpo
from ...config import ODCConfig
from .reference import check_reference_settings

__all__ = [
    "check_grpo_args",
    "check_grpo_settings",
    "check_generation_steps",
    "generation_slices",
    "check_vllm_args",
    "check_vllm_sync_settings",
    "optimizer_steps_per_generation",
]


def check_grpo_settings(args: Any, model: Any, config: ODCConfig) -> None:
    """Refuse what ODC cannot do (exactly) with these GRPO arguments and model, before the trainer folds gradient
    accumulation, shards any model, builds any vLLM engine or generates any completion.

    Args:
        args (`ODCGRPOConfig` or `trl.GRPOConfig`): the training arguments.
        model (`transformers.PreTrainedModel` or `peft.PeftModel`): the policy.
        config (`ODCConfig`): the trainer's resolved options.
    """
    check_grpo_args(args, config)
    check_vllm_sync_settings(args, model, config)


def check_vllm_sync_settings(args: Any, model: Any, config: ODCConfig) -> None:
    """Under ODC with vLLM, refuse a model whose per-rank weight sync would be wrong, before TRL builds the engine
    (`odc_accelerate.integrations.vllm.check_vllm_sync_model`)."""
    if config.enable and getattr(args, "use_vllm", False):
        from ..vllm import check_vllm_sync_model

        check_vllm_sync_model(model)


def check_grpo_args(args: Any, config: ODCConfig) -> None:
    """Refuse, before any work (and before any vLLM engine is created), the GRPO settings ODC cannot run (exactly)."""
    if config.enable and getattr(args, "use_vllm", False):
        check_vllm_args(args)
    check_reference_settings(args, config)
    if not config.balanced:
        return
    alternatives = "run without --odc / --odc_plan (plain FSDP2 with TRL's own microbatches)"
    loss_type = getattr(args, "loss_type", None)
    if loss_type not in trl_grpo.GRPO_LOSS_NORMALISATION:
        raise ValueError(
            f"loss_type={loss_type!r} has no exact rescaling under ODC's balanced plan. Use one of "
            f"{sorted(trl_grpo.GRPO_LOSS_NORMALISATION)}, or {alternatives}."
        )
    check_generation_steps(args, alternatives)
    if float(getattr(args, "entropy_coef", 0.0) or 0.0) != 0.0 or getattr(args, "use_adaptive_entropy", False):
        raise ValueError(
            "The entropy bonus (entropy_coef / use_adaptive_entropy) is a mean over each microbatch's tokens, which "
            f"cannot be made exact when ranks run different microbatches. Set --entropy_coef 0, or {alternatives}."
        )
    if float(getattr(args, "top_entropy_quantile", 1.0)) < 1.0:
        raise ValueError(
            "top_entropy_quantile < 1 masks tokens by an entropy quantile of each microbatch, which depends on how "
            f"completions are grouped into microbatches. Set --top_entropy_quantile 1.0, or {alternatives}."
        )


def check_generation_steps(args: Any, alternatives: str) -> None:
    """Refuse, under a balanced plan, an optimizer step that would train on more than one generation batch.

    A generation batch (``steps_per_generation`` slices of ``per_device_train_batch_size`` completions per rank) feeds
    ``num_iterations x steps_per_generation / gradient_accumulation_steps`` optimizer steps, each planned over the
    ``gradient_accumulation_steps`` slices it trains (see `.online.ODCOnlineTrainerMixin`); that needs
    ``steps_per_generation`` to be a multiple of ``gradient_accumulation_steps``. Any ``num_iterations`` is served.

    Args:
        args: the trainer's arguments (``steps_per_generation``, ``gradient_accumulation_steps``, read before the
            trainer folds the accumulation).
        alternatives (`str`): what else the user can do, ending the messages.
    """
    spg, ga = getattr(args, "steps_per_generation", None), int(args.gradient_accumulation_steps)
    if spg is None or int(spg) % ga == 0:
        return
    spg = int(spg)
    if spg < ga:
        raise ValueError(
            f"steps_per_generation={spg} is below gradient_accumulation_steps={ga}: each optimizer step would train "
            "on several generation batches, generated in the middle of the step, which ODC's balanced plan (one "
            "plan per step, made once its completions exist) cannot do. Set --steps_per_generation to a multiple of "
            f"--gradient_accumulation_steps (or leave it unset), or {alternatives}."
        )
    raise ValueError(
        f"steps_per_generation={spg} is not a multiple of gradient_accumulation_steps={ga}: an optimizer step would "
        "train on the end of one generation batch and the start of the next, which ODC's balanced plan (one plan per "
        "step, made once its completions exist) cannot do. Set --steps_per_generation to a multiple of "
        f"--gradient_accumulation_steps, or {alternatives}."
    )


def optimizer_steps_per_generation(args: Any, accumulation: int) -> int:
    """The optimizer steps one generation batch feeds under a balanced plan: each of its `generation_slices` steps'
    worth of completions, trained ``num_iterations`` times."""
    return generation_slices(args, accumulation) * int(getattr(args, "num_iterations", 1))


def generation_slices(args: Any, accumulation: int) -> int:
    """How many optimizer steps' worth of completions one generation batch holds: ``steps_per_generation /
    gradient_accumulation_steps`` (``accumulation``: TRL's, before the trainer folds it; `check_generation_steps`
    holds)."""
    spg = getattr(args, "steps_per_generation", None)
    return max(1, int(spg if spg is not None else accumulation) // int(accumulation))


def check_vllm_args(args: Any) -> None:
    """Refuse the vLLM settings ODC's per-rank weight sync cannot serve: it refreshes one colocated engine per rank
    (``vllm_mode="colocate"``, ``vllm_tensor_parallel_size=1``) with the full weights of the model (LoRA adapters
    merged, see `odc_accelerate.integrations.vllm.iter_full_parameters`)."""
    mode = getattr(args, "vllm_mode", "colocate")
    if mode == "server":
        raise ValueError(
            "vllm_mode='server' is not supported with ODC: TRL's server mode syncs the weights by gathering the full "
            "model with collectives on every rank and broadcasting it from rank 0 to the server, and sends every "
            "rank's prompts through rank 0, so each step's generation waits for every rank. Use --vllm_mode "
            "colocate (each rank then refreshes its own engine from ODC's shards and generates its own prompts, "
            "without collectives), or run without --odc."
        )
    tp = int(getattr(args, "vllm_tensor_parallel_size", 1) or 1)
    if mode == "colocate" and tp != 1:
        raise ValueError(
            f"vllm_tensor_parallel_size={tp} is not supported with ODC: each rank refreshes its own colocated vLLM "
            "engine, which must hold the whole model (a tensor-parallel engine spans ranks, and generates in "
            "lockstep with them). Set --vllm_tensor_parallel_size 1, or run without --odc."
        )
