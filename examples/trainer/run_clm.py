# Copyright 2026 The odc_accelerate authors. Shaped after transformers' examples/pytorch/language-modeling/run_clm.py
# (Apache-2.0).
"""Causal language modelling with a plain `transformers.Trainer`: no ODC code in the script.

Under ``odc-accelerate launch`` with a config that asks for ODC, the launcher puts `odc_accelerate.ODCTrainer` in
place of ``transformers.Trainer`` before the script runs, so this script trains with ODC unmodified (see README.md
beside this file):

    odc-accelerate launch --config_file examples/sft/configs/odc_cpu.yaml examples/trainer/run_clm.py \
        --max_steps 3 --logging_steps 1 --output_dir OUT

Without ``--model_name_or_path`` it needs no network: the offline default model, tokenizer and text (the package's
``demo`` extra) that the other examples train.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    DataCollatorWithFlattening,
    DataCollatorWithPadding,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A model and tokenizer to load (default: the offline tiny Qwen2, no network)."}
    )
    block_size: int = field(default=128, metadata={"help": "Tokens per sample: texts are truncated to it."})
    group_texts: bool = field(
        default=False,
        metadata={"help": "Concatenate the texts and cut them into blocks of block_size tokens (run_clm's default)."},
    )
    collator: str = field(
        default="lm",
        metadata={
            "help": "lm: DataCollatorForLanguageModeling(mlm=False); flattening: DataCollatorWithFlattening; "
            "default: default_data_collator (samples of one length: with --group_texts); padding: "
            "DataCollatorWithPadding (with --group_texts, which adds labels)."
        },
    )


def load_model_and_tokenizer(script_args: ScriptArguments, seed: int):
    set_seed(seed)  # every rank starts from the same weights
    if script_args.model_name_or_path is not None:
        tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(
            script_args.model_name_or_path, dtype=torch.float32, attn_implementation="sdpa"
        )
        return model, tokenizer
    from odc_accelerate.demo import load_offline_tokenizer, tiny_qwen2_config

    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(), dtype=torch.float32, attn_implementation="sdpa")
    return model, load_offline_tokenizer()


def training_set(tokenizer, script_args: ScriptArguments, training_args: TrainingArguments):
    from odc_accelerate.demo import offline_sft_dataset

    raw = offline_sft_dataset()
    block_size = script_args.block_size

    def tokenize(batch):
        return tokenizer(batch["text"], truncation=not script_args.group_texts, max_length=block_size)

    def group_texts(examples):
        # as run_clm: concatenate, drop the remainder, cut into blocks; the labels are the inputs (the model shifts)
        concatenated = {k: sum(examples[k], []) for k in examples}
        total = (len(concatenated["input_ids"]) // block_size) * block_size
        result = {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}
        result["labels"] = [ids.copy() for ids in result["input_ids"]]
        return result

    with training_args.main_process_first(desc="tokenizing"):
        dataset = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
        if script_args.group_texts:
            dataset = dataset.map(group_texts, batched=True)
    return dataset


def data_collator(name: str, tokenizer):
    collators = {
        "lm": lambda: DataCollatorForLanguageModeling(tokenizer, mlm=False),
        "flattening": DataCollatorWithFlattening,
        "default": lambda: default_data_collator,
        "padding": lambda: DataCollatorWithPadding(tokenizer),
    }
    if name not in collators:
        raise ValueError(f"--collator must be one of {', '.join(collators)}, not {name!r}.")
    return collators[name]()


def main() -> None:
    script_args, training_args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    model, tokenizer = load_model_and_tokenizer(script_args, training_args.seed)
    train_dataset = training_set(tokenizer, script_args, training_args)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        data_collator=data_collator(script_args.collator, tokenizer),
    )
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_metrics("train", train_result.metrics)
    trainer.save_state()
    trainer.accelerator.end_training()  # finish the trackers and destroy the process group before exit


if __name__ == "__main__":
    main()
