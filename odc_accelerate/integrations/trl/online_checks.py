"""What ODC refuses of an online (GRPO, RLOO) run, before any work: GRPO's loss types and options whose loss cannot be
made exact under a plan (`check_grpo_args`), the vLLM settings ODC's weight sync cannot serve
(`check_vllm_args`), a model that sync would get wrong (`check_vllm_sync_settings`), and more than one generation batch
per optimizer step (`check_one_generation_per_step`), and prompts with images under a plan (`check_no_images`)."""

from __future__ import annotations

from typing import Any

from ..._compat.trl import grpo as trl_grpo
from ...config import ODCConfig
from .reference import check_reference_settings

__all__ = [
    "check_grpo_args",
    "check_grpo_settings",
    "check_no_images",
    "check_one_generation_per_step",
    "check_vllm_args",
    "check_vllm_sync_settings",
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
    check_one_generation_per_step(args, alternatives)
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


def check_one_generation_per_step(args: Any, alternatives: str) -> None:
    """Refuse, under a balanced plan, the settings that would train a generation batch over several optimizer steps:
    ODC plans one generation batch per optimizer step.

    Args:
        args: the trainer's arguments (``num_iterations``, ``steps_per_generation``, ``gradient_accumulation_steps``).
        alternatives (`str`): what else the user can do, ending the messages.
    """
    if int(getattr(args, "num_iterations", 1)) != 1:
        raise ValueError(
            f"num_iterations={args.num_iterations}: ODC's balanced plan trains each generation batch in one optimizer "
            f"step. Set --num_iterations 1, or {alternatives}."
        )
    spg, ga = getattr(args, "steps_per_generation", None), int(args.gradient_accumulation_steps)
    if spg is not None and int(spg) != ga:
        raise ValueError(
            f"steps_per_generation={spg} differs from gradient_accumulation_steps={ga}: ODC's balanced plan trains "
            "each generation batch in one optimizer step. Leave --steps_per_generation unset (or equal to "
            f"--gradient_accumulation_steps), or {alternatives}."
        )


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
