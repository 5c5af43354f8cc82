"""Distillation on fixed completions, for the parity tests: ODC on several ranks vs TRL alone on one process.

    accelerate launch --config_file CFG tests/helpers/loops/run_example.py tests/helpers/loops/distillation_loop.py \
        --odc true --output_dir OUT
    python tests/helpers/loops/distillation_loop.py --reference true --per_device_train_batch_size 16 --output_dir OUT

The student's one-turn generation returns a seeded stand-in (the completion of a prompt is a function of its text
alone, long-tailed lengths, some ending at EOS), on the ODC trainer and on TRL's alike, so every run trains on the
same completions whatever the number of ranks and the comparison is of training. Student: the tiny Qwen2 (hidden 32,
seed 0); teacher: the same shape twice as wide (hidden 64, seed 1), the same vocabulary. With ``--reference true`` the
run is plain `trl.DistillationTrainer`. Rank 0 writes ``OUT/losses.json`` (the log history), ``OUT/initial_params.pt``
and ``OUT/final_params.pt``.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_FIRST_TOKEN, _LAST_TOKEN = 1000, 20000  # ordinary word pieces of Qwen's vocabulary (of its first ranks kept)


@dataclass
class LoopArguments:
    reference: bool = field(default=False, metadata={"help": "Run plain trl.DistillationTrainer on one process."})
    num_prompts: int = field(default=32, metadata={"help": "Prompts in the dataset."})


def fixed_completion(prompt: str, limit: int, eos: int) -> list[int]:
    """A completion that depends on the prompt's text only; about a third end at EOS before ``limit``."""
    rng = np.random.default_rng(zlib.crc32(prompt.encode()))
    length = int(min(limit, 2 + rng.pareto(1.1) * 6))
    tokens = rng.integers(_FIRST_TOKEN, min(_LAST_TOKEN, eos), size=length).tolist()
    if rng.random() < 0.35 and length < limit:
        tokens.append(eos)
    return tokens


def with_fixed_completions(trainer_cls: type) -> type:
    """``trainer_cls`` whose one-turn generation returns `fixed_completion` of each prompt."""

    class FixedCompletions(trainer_cls):
        def _generate_single_turn(self, prompt_ids: list, images: Any, multimodal_fields: Any, **kwargs: Any) -> list:
            tokenizer = self.processing_class
            prompts = tokenizer.batch_decode(prompt_ids)
            limit, eos = int(self.max_completion_length), int(tokenizer.eos_token_id)
            return [fixed_completion(p, limit, eos) for p in prompts]

    FixedCompletions.__name__ = FixedCompletions.__qualname__ = f"FixedCompletions{trainer_cls.__name__}"
    return FixedCompletions


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, set_seed
    from trl import DistillationConfig, DistillationTrainer, TrlParser

    from odc_accelerate.demo import load_offline_tokenizer, offline_texts, tiny_qwen2_config
    from odc_accelerate.integrations.trl import ODCDistillationConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    reference = "--reference" in argv and argv[argv.index("--reference") + 1].lower() == "true"
    parser = TrlParser((LoopArguments, DistillationConfig if reference else ODCDistillationConfig))
    loop_args, args = parser.parse_args_into_dataclasses(argv)
    tokenizer = load_offline_tokenizer()
    models = []
    for seed, hidden in ((0, 32), (1, 64)):
        set_seed(seed)
        config = tiny_qwen2_config(hidden_size=hidden)
        models.append(AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa"))
    student, teacher = models
    initial = {n: p.detach().clone() for n, p in student.named_parameters()}

    from datasets import Dataset

    texts = offline_texts(max_words=80, seed=1)[: loop_args.num_prompts]
    dataset = Dataset.from_dict({"prompt": [" ".join(t.split()[:8]) for t in texts]})
    if loop_args.reference:
        trainer_cls = DistillationTrainer
    else:
        from odc_accelerate.integrations.trl import ODCDistillationTrainer

        trainer_cls = ODCDistillationTrainer
    trainer = with_fixed_completions(trainer_cls)(
        model=student, teacher_model=teacher, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    _save(trainer, initial)
    from odc_accelerate._compat.transformers import end_training

    end_training(trainer)


def _save(trainer: Any, initial: dict) -> None:
    import torch

    params = {}
    for name, p in trainer.model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        params[name] = full.detach().float().cpu()
    out = trainer.args.output_dir
    if trainer.accelerator.is_main_process:
        os.makedirs(out, exist_ok=True)
        torch.save(initial, os.path.join(out, "initial_params.pt"))
        torch.save(params, os.path.join(out, "final_params.pt"))
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump({"log_history": trainer.state.log_history}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
