"""RLOO on fixed completions, for the parity tests: ODC on several ranks vs TRL alone on one process.

    accelerate launch --config_file CFG tests/helpers/loops/rloo_loop.py --odc true --output_dir OUT
    python tests/helpers/loops/rloo_loop.py --reference true --per_device_train_batch_size 16 --output_dir OUT

RLOOTrainer has no ``rollout_func``: the completions come from the seeded stand-in of `tests.helpers.loops.grpo_loop`
(``stub_rollout``: the completion of the ``j``-th copy of a prompt is a function of the prompt's text and ``j``
alone, long-tailed lengths), returned where TRL's trainer generates one turn, on the ODC trainer and on TRL's alike.
Every run sees the same completions whatever the number of ranks, so the comparison is of training: TRL computes the
old and reference log-probs, the KL-in-reward term and the leave-one-out advantages from them. The reward is
`grpo_loop.length_rule_reward`, except that it returns ``None`` (unscorable: TRL's NaN-aware baseline) for every
completion whose text length is a multiple of 5. With ``--reference true`` the run is plain `trl.RLOOTrainer`. Rank 0
writes ``OUT/losses.json`` (the log history), ``OUT/initial_params.pt`` and ``OUT/final_params.pt``.
``--extra_runs``, ``--fixed_slices`` and ``--reference_ranks`` are `tests.helpers.loops.grpo_loop`'s.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from tests.helpers.loops.grpo_loop import (
    extra_runs,
    length_rule_reward,
    stub_rollout,
    token_share_aux,
    use_fixed_slices,
)


@dataclass
class LoopArguments:
    reference: bool = field(default=False, metadata={"help": "Run plain trl.RLOOTrainer on one process."})
    num_prompts: int = field(default=32, metadata={"help": "Prompts in the dataset."})
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A saved model (e.g. `save_tiny_causal_lm`'s); default: the offline tiny Qwen2, seed 0."},
    )
    aux_token_share: bool = field(
        default=False,
        metadata={"help": "Reference only: a MoE router's auxiliary loss as `grpo_loop.token_share_aux` weights it."},
    )
    extra_runs: str | None = field(default=None, metadata={"help": "As grpo_loop's: 'NAME:ARGS;...' (OUT/NAME)."})
    fixed_slices: bool = field(default=False, metadata={"help": "As grpo_loop's: generation batches sliced in order."})
    reference_ranks: int = field(default=2, metadata={"help": "As grpo_loop's (with --fixed_slices)."})


def sometimes_unscorable_reward(completions: list[str], **kwargs: Any) -> list[float | None]:
    """`length_rule_reward`, or ``None`` for a completion whose text length is a multiple of 5."""
    rewards = length_rule_reward(completions)
    return [None if len(c) % 5 == 0 else r for c, r in zip(completions, rewards, strict=True)]


def with_fixed_completions(trainer_cls: type) -> type:
    """``trainer_cls`` whose one-turn generation returns `stub_rollout`'s completions of its prompts."""

    class FixedCompletions(trainer_cls):
        def _generate_single_turn(self, prompt_ids: list, images: Any, multimodal_fields: Any) -> list:
            prompts = self.processing_class.batch_decode(prompt_ids)
            return stub_rollout(prompts, self)["completion_ids"]

    FixedCompletions.__name__ = FixedCompletions.__qualname__ = f"FixedCompletions{trainer_cls.__name__}"
    return FixedCompletions


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, set_seed
    from trl import RLOOConfig, RLOOTrainer, TrlParser

    from odc_accelerate.demo import load_offline_tokenizer, offline_texts, tiny_qwen2_config
    from odc_accelerate.integrations.trl import ODCRLOOConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    reference = "--reference" in argv and argv[argv.index("--reference") + 1].lower() == "true"
    parser = TrlParser((LoopArguments, RLOOConfig if reference else ODCRLOOConfig))
    loop_args, args = parser.parse_args_into_dataclasses(argv)
    tokenizer = load_offline_tokenizer()
    if loop_args.model_name_or_path:
        path = loop_args.model_name_or_path
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    else:
        set_seed(0)
        model = AutoModelForCausalLM.from_config(
            tiny_qwen2_config(hidden_size=32), dtype=torch.float32, attn_implementation="sdpa"
        )
        # TRL builds the reference model (beta > 0) from the policy's path: pass a path, written by the main process.
        from accelerate import PartialState

        state = PartialState()
        path = os.path.join(args.output_dir, "init_model")
        with state.main_process_first():
            if state.is_main_process:
                model.save_pretrained(path)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    args.model_init_kwargs = {"dtype": "float32", "attn_implementation": "sdpa"}

    from datasets import Dataset

    texts = offline_texts(max_words=80, seed=1)[: loop_args.num_prompts]
    dataset = Dataset.from_dict({"prompt": [" ".join(t.split()[:8]) for t in texts]})
    if loop_args.reference:
        trainer_cls = token_share_aux(RLOOTrainer) if loop_args.aux_token_share else RLOOTrainer
    else:
        from odc_accelerate.integrations.trl import ODCRLOOTrainer

        trainer_cls = ODCRLOOTrainer
    runs = [([], None), *((extra, folder) for folder, extra in extra_runs(loop_args.extra_runs))]
    root = args.output_dir
    for i, (extra, folder) in enumerate(runs):
        if folder is not None:  # fresh arguments: a trainer may change its own (gradient accumulation)
            loop_args, args = parser.parse_args_into_dataclasses([*argv, *extra, "--output_dir", f"{root}/{folder}"])
            args.model_init_kwargs = {"dtype": "float32", "attn_implementation": "sdpa"}
        use_fixed_slices(loop_args, args)
        trainer = with_fixed_completions(trainer_cls)(
            model=path,
            reward_funcs=sometimes_unscorable_reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        trainer.train()
        _save(trainer, initial)
        if i < len(runs) - 1 and not loop_args.reference:
            # The next trainer prepares a new model in the same process group: free this one's ODC engines.
            from odc_accelerate.integrations.accelerate import get_engine, get_frozen_engines

            for engine in [get_engine(trainer.accelerator), *get_frozen_engines(trainer.accelerator)]:
                if engine is not None:
                    engine.close()
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
