# Copyright 2026 The odc_accelerate authors. Derived from TRL's trl/scripts/distillation.py (Apache-2.0).
"""On-policy distillation with ODC: TRL's ``trl/scripts/distillation.py`` with the ODC trainer and an offline default.

Every argument of TRL's script is accepted, plus the ODC options (`odc_accelerate.config.ODCConfig`): ``--odc``,
``--odc_transport``, ``--odc_timeout``, ``--odc_max_tokens_per_microbatch``, ``--odc_plan`` (``free``, ``lockstep`` or
``dynamic``), ``--odc_reproducible``, ``--odc_samples_per_step``, ``--odc_trace_dir``, ``--odc_time_collectives``,
``--odc_metrics``, ``--odc_memory_policy``, ``--odc_memory_headroom`` and ``--odc_reduction``. Without
``--model_name_or_path`` (and ``--teacher_model_name_or_path``) and ``--dataset_name`` it distils a wider tiny Qwen2
teacher into the GRPO script's offline student on the GRPO script's offline prompts, no network (`odc_accelerate.demo`).

    odc-accelerate distillation --max_steps 3 --logging_steps 1 --output_dir OUT
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from typing import TYPE_CHECKING

from trl import ScriptArguments

from odc_accelerate import ODCDistillationConfig, ODCDistillationTrainer
from odc_accelerate.scripts._common import (
    demo_sizes,
    load_datasets,
    make_trl_parser,
    offline_models,
    set_model_init_kwargs,
    train_and_save,
)
from odc_accelerate.scripts.grpo import OFFLINE_SHAPE

if TYPE_CHECKING:
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

#: The offline teacher: the offline student's shape, twice as wide (the vocabulary is the same, as distillation needs).
OFFLINE_TEACHER_SHAPE = {**OFFLINE_SHAPE, "hidden_size": 2 * OFFLINE_SHAPE["hidden_size"]}


def main(
    script_args: ScriptArguments,
    training_args: ODCDistillationConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig,
    given: Collection[str] | None = None,
) -> None:
    """Train as TRL's script does, with `ODCDistillationTrainer` (the arguments are ``make_parser()``'s
    dataclasses)."""
    from accelerate.logging import get_logger
    from trl import get_peft_config, get_quantization_config

    logger = get_logger(__name__)
    offline_model = not model_args.model_name_or_path
    processing_class = None
    if not offline_model:
        if training_args.teacher_model_name_or_path is None:
            raise ValueError(
                "A teacher model is required for distillation training. Set it with `--teacher_model_name_or_path`."
            )
        set_model_init_kwargs(training_args, model_args)
        # As TRL's script: the teacher gets the model arguments (its own revision), unquantized.
        teacher_init = dict(
            revision=training_args.teacher_model_revision,
            trust_remote_code=training_args.trust_remote_code,
            attn_implementation=model_args.attn_implementation,
            dtype=model_args.dtype,
        )
        teacher_init.update(training_args.teacher_model_init_kwargs or {})
        training_args.teacher_model_init_kwargs = teacher_init
        model, teacher = model_args.model_name_or_path, training_args.teacher_model_name_or_path
    else:
        if training_args.teacher_model_name_or_path is not None:
            raise ValueError(
                "--teacher_model_name_or_path needs --model_name_or_path (a student of the same vocabulary); without "
                "both, the offline default's student and teacher are used."
            )
        logger.info("No --model_name_or_path: offline default (tiny Qwen2 student and a wider teacher, from config).")
        demo_sizes(training_args, {"max_completion_length": 64, "per_device_train_batch_size": 4}, given)
        (model,), processing_class = offline_models(training_args, model_args, shape=OFFLINE_SHAPE)
        (teacher,), _ = offline_models(training_args, model_args, shape=OFFLINE_TEACHER_SHAPE)

    def offline():
        from odc_accelerate.demo import offline_grpo_dataset

        logger.info("No --dataset_name: offline default (prompts from pydoc_data help topics).")
        return offline_grpo_dataset(tokenizer=processing_class)

    dataset = load_datasets(script_args, dataset_args, offline, logger)
    trainer = ODCDistillationTrainer(
        model=model,
        teacher_model=teacher,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        processing_class=processing_class,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    train_and_save(trainer, training_args, script_args)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> TrlParser:
    """The script's argument parser: TRL's distillation dataclasses, with `ODCDistillationConfig` for
    ``DistillationConfig``."""
    from trl import DatasetMixtureConfig, ModelConfig

    dataclass_types = (ScriptArguments, ODCDistillationConfig, ModelConfig, DatasetMixtureConfig)
    return make_trl_parser(dataclass_types, "distillation", subparsers, prog)


if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(fail_with_unknown_args=False)
    main(script_args, training_args, model_args, dataset_args, given=parser.given)
