"""What ODC refuses of an online (GRPO, RLOO) run, before any work: GRPO's loss types and options whose loss cannot be
made exact under a plan (`check_grpo_args`), the vLLM settings ODC's weight sync cannot serve
(`check_vllm_args`), a model that sync would get wrong (`check_vllm_sync_settings`), an optimizer step that would
take more than one generation batch (`check_generation_steps`), and prompts with images under a plan
(`check_no_images`)."""

from __future__ import annotations

from typing import Any

from ..._compat.trl import grpo as trl_grpo
from ...config import ODCConfig
from .reference import check_reference_settings

__all__ = [
    "check_grpo_args",
    "check_grpo_settings",
    "check_generation_steps",
    "check_no_images",
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
    """Refuse the vLLM settings ODC's weight sync cannot serve. In colocate mode it refreshes one engine per rank,
    which must hold the whole model (``vllm_tensor_parallel_size=1``); in server mode rank 0 pushes the full weights
    to the server (`odc_accelerate.integrations.vllm_server`), whose own parallelism is the server's. Either way the
    weights are the model's in full (LoRA adapters merged, see `odc_accelerate.integrations.vllm.iter_full_parameters`).
    """
    mode = getattr(args, "vllm_mode", "colocate")
    tp = int(getattr(args, "vllm_tensor_parallel_size", 1) or 1)
    if mode == "colocate" and tp != 1:
        raise ValueError(
            f"vllm_tensor_parallel_size={tp} is not supported with ODC: each rank refreshes its own colocated vLLM "
            "engine, which must hold the whole model (a tensor-parallel engine spans ranks, and generates in "
            "lockstep with them). Set --vllm_tensor_parallel_size 1, use --vllm_mode server (the server's own "
            "tensor parallelism), or run without --odc."
        )


def has_images(row: Any) -> bool:
    """Whether a prompt row carries images: an ``image`` / ``images`` column (TRL's vision format), or an image part
    in a conversational prompt."""
    if not isinstance(row, dict):
        return False
    if row.get("image") is not None or row.get("images"):
        return True
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        for message in prompt:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content):
                return True
    return False


def check_no_images(dataset: Any, trainer: str, config: ODCConfig) -> None:
    """Refuse, under a balanced plan and before any work, a prompt dataset with images (its first row, as TRL reads
    it): the plan re-batches the generated completions across ranks, and an image's ``pixel_values`` and
    ``image_grid_thw`` cannot yet travel with its completions (`.rollouts.split_rollouts` would stop the first
    step, after generation)."""
    if not config.balanced or dataset is None or not hasattr(dataset, "__getitem__"):
        return  # a stream is refused under a plan on its own (`ODCOnlineTrainerMixin.get_train_dataloader`)
    try:
        first = dataset[0] if len(dataset) else None
    except (TypeError, KeyError, IndexError):
        return
    if has_images(first):
        raise ValueError(
            f"{trainer} on prompts with images is not supported under an ODC plan: the plan re-batches the "
            "generated completions across ranks, and their images (pixel_values, image_grid_thw) cannot yet go "
            "with them. Run without --odc / --odc_plan (plain FSDP2 with TRL's own microbatches), or train on "
            "text prompts."
        )
