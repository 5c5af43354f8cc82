# Shaped after transformers' examples/pytorch/text-classification/run_glue.py (Apache-2.0).
"""Sequence classification with a plain `transformers.Trainer`, as run_glue trains it: no ODC code in the script.

A tiny ``Qwen2ForSequenceClassification`` (2 labels, the offline tokenizer's pad token in its config) trains on the
offline texts cut to 3 to 27 words, one ``label`` per sample, collated by the Trainer's default for a tokenizer
(``DataCollatorWithPadding``: pads the inputs, renames ``label`` to ``labels``). Options of the script's own:

* ``--own_loss true``: the trainer is a ``MyTrainer(Trainer)`` whose ``compute_loss`` returns the model's mean over
  the batch (``loss_is_scaled_for_ga = False``: the Trainer divides it by the accumulation steps);
* ``--own_loader true``: ``MyTrainer`` builds its own training loader (``get_train_dataloader``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader
from transformers import (
    AutoModelForSequenceClassification,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    set_seed,
)


@dataclass
class ScriptArguments:
    own_loss: bool = False
    own_loader: bool = False


class MyTrainer(Trainer):
    loss_is_scaled_for_ga = False  # a mean over the batch: the Trainer divides it by the accumulation steps

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


class MyLoaderTrainer(Trainer):
    def get_train_dataloader(self):
        return DataLoader(
            self.train_dataset, batch_size=self.args.per_device_train_batch_size, collate_fn=self.data_collator
        )


def main() -> None:
    from odc_accelerate.demo import load_offline_tokenizer, offline_sft_dataset
    from odc_accelerate.testing.models import tiny_causal_lm_config

    script_args, training_args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    tokenizer = load_offline_tokenizer()
    config = tiny_causal_lm_config("untied", 64)
    config.num_labels = 2
    config.pad_token_id = tokenizer.pad_token_id
    set_seed(training_args.seed)  # every rank starts from the same weights
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32, attn_implementation="sdpa")

    def tokenize(batch, indices):
        texts = [" ".join(t.split()[: 3 + (7 * i) % 25]) for t, i in zip(batch["text"], indices, strict=True)]
        out = tokenizer(texts, truncation=True, max_length=64)
        out["label"] = [i % 2 for i in indices]
        return out

    raw = offline_sft_dataset()
    with training_args.main_process_first(desc="tokenizing"):
        dataset = raw.map(tokenize, batched=True, with_indices=True, remove_columns=raw.column_names)
    cls = MyTrainer if script_args.own_loss else MyLoaderTrainer if script_args.own_loader else Trainer
    trainer = cls(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer)
    result = trainer.train()
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
