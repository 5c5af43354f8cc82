"""Plain `trl.GRPOTrainer` on one process, training on the completions an ODC run generated with vLLM: the ground truth
of the vLLM GRPO test (tests/vllm/test_grpo_vllm.py).

    python tests/helpers/loops/grpo_vllm_replay.py --odc_run ODC_OUT --per_device_train_batch_size 8 ... --output_dir OUT

The ODC run (``odc-accelerate grpo --use_vllm true`` through `tests/helpers/loops/run_example.py` with
``ODC_TEST_VLLM_CHECK=1``) saved its initial model in ``ODC_OUT/initial_model`` and each rank's vLLM rollouts (prompt
ids, completion ids and vLLM's log-probs of every ``generate`` call) in ``ODC_OUT/vllm_check_rank<r>.json``. Here TRL
trains the same initial model on the same offline prompts and rewards with ``use_vllm=True`` (so TRL's own
importance-sampling correction on vLLM's log-probs runs), except that TRL's `VLLMGeneration` is replaced by a replay:
its ``generate`` call number ``k`` returns the ranks' ``k``-th rollouts, concatenated in rank order (the order of the
global batch), after checking that TRL asks for exactly those prompts; ``sync_weights`` does nothing. With
``per_device_train_batch_size`` = the ODC run's times its ranks, each optimizer step is one microbatch of the ODC
step's completions.

Writes ``OUT/losses.json`` (the log history) and ``OUT/final_params.pt``.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ReplayArguments:
    odc_run: str = field(metadata={"help": "Output folder of the ODC run whose vLLM rollouts are replayed."})


def _recorded(odc_run: str) -> list[dict[str, Any]]:
    """The ODC run's ``generate`` calls, each with its ranks' rollouts concatenated in rank order."""
    ranks = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(odc_run, "vllm_check_rank*.json")))]
    if not ranks:
        raise FileNotFoundError(f"no vllm_check_rank*.json in {odc_run}")
    ranks.sort(key=lambda r: r["rank"])
    calls = []
    for per_rank in zip(*(r["rollouts"] for r in ranks), strict=True):
        calls.append(
            {key: [x for r in per_rank for x in r[key]] for key in ("prompt_ids", "completion_ids", "logprobs")}
        )
    return calls


class ReplayVLLMGeneration:
    """TRL's `VLLMGeneration` in colocate mode, replaying recorded generations."""

    calls: list[dict[str, Any]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.mode = kwargs.get("mode", "colocate")
        self.llm = None
        self._next = 0

    def sync_weights(self) -> None:
        pass

    def generate(self, prompts: list, images: Any, num_generations: int, profiler: Any = None) -> tuple:
        call = self.calls[self._next]
        self._next += 1
        if [list(map(int, p)) for p in prompts] != call["prompt_ids"]:
            raise AssertionError(
                f"generate call {self._next}: TRL asks for other prompts than the ODC run generated for "
                f"({[len(p) for p in prompts]} tokens vs {[len(p) for p in call['prompt_ids']]})"
            )
        return call["prompt_ids"], call["completion_ids"], call["logprobs"], None


def main(argv: list[str]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer, TrlParser
    from trl.trainer import grpo_trainer

    from odc_accelerate.demo import ascii_text_reward, continuation_overlap_reward, offline_grpo_dataset

    replay_args, args = TrlParser((ReplayArguments, GRPOConfig)).parse_args_into_dataclasses(argv)
    ReplayVLLMGeneration.calls = _recorded(replay_args.odc_run)
    grpo_trainer.VLLMGeneration = ReplayVLLMGeneration  # the name GRPOTrainer.__init__ builds its backend from

    path = os.path.join(replay_args.odc_run, "initial_model")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[continuation_overlap_reward, ascii_text_reward],
        args=args,
        train_dataset=offline_grpo_dataset(tokenizer=tokenizer),
        processing_class=tokenizer,
    )
    trainer.train()
    out = args.output_dir
    os.makedirs(out, exist_ok=True)
    params = {name: p.detach().float().cpu() for name, p in trainer.model.named_parameters()}
    torch.save(params, os.path.join(out, "final_params.pt"))
    with open(os.path.join(out, "losses.json"), "w") as f:
        json.dump({"log_history": trainer.state.log_history, "generate_calls": trainer.vllm_generation._next}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
