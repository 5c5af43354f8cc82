"""GRPO on fixed completions, for the parity tests: ODC on several ranks vs TRL alone on one process.

    accelerate launch --config_file CFG tests/helpers/loops/grpo_loop.py --odc true --odc_plan free --output_dir OUT
    python tests/helpers/loops/grpo_loop.py --reference true --per_device_train_batch_size 16 --output_dir OUT

Completions come from a seeded stand-in for generation (TRL's public ``rollout_func``): the completion of the ``j``-th
copy of a prompt is a function of the prompt's text and ``j`` alone, with a long-tailed length, so every run sees the
same completions whatever the number of ranks, and the comparison is of training. The reward is a rule on the
completion's text. With ``--reference true`` the run is plain `trl.GRPOTrainer` (no ODC class involved). Rank 0
writes ``OUT/losses.json`` (the logged loss of every step), ``OUT/initial_params.pt`` and ``OUT/final_params.pt``.

``--extra_runs "NAME:ARGS;..."`` trains more runs after those, in the same process group, each with ARGS added
(into OUT/NAME). ``--fixed_slices true`` replaces TRL's random shuffle of a generation batch before its
``steps_per_generation`` slices (`fixed_slices_shuffle`), so that a one-process reference trains the same completions
in each optimizer step as a run on ``--reference_ranks`` ranks.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_FIRST_TOKEN, _LAST_TOKEN = 1000, 20000  # ordinary word pieces of Qwen's vocabulary (of its first ranks kept)


@dataclass
class LoopArguments:
    reference: bool = field(default=False, metadata={"help": "Run plain trl.GRPOTrainer on one process."})
    num_prompts: int = field(default=32, metadata={"help": "Prompts in the dataset."})
    stub_rollout: bool = field(default=True, metadata={"help": "Fixed completions; false: TRL generates them."})
    loss_types: str | None = field(
        default=None, metadata={"help": "Comma-separated loss types trained one after the other (OUT/<type>)."}
    )
    kl_free_loss_types: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated loss types trained after --loss_types with beta=0 (no KL term, no reference "
            "model), into OUT/<type>_beta0."
        },
    )
    extra_runs: str | None = field(
        default=None,
        metadata={"help": "Runs trained after the others: 'NAME:ARGS;NAME:ARGS', each into OUT/NAME with ARGS added."},
    )
    fixed_slices: bool = field(
        default=False,
        metadata={
            "help": "Slice generation batches in a fixed order (fixed_slices_shuffle) instead of TRL's shuffle."
        },
    )
    reference_ranks: int = field(
        default=2, metadata={"help": "With --fixed_slices: the ranks of the run a one-process reference stands for."}
    )
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A saved model (e.g. `save_tiny_causal_lm`'s); default: the offline tiny Qwen2, seed 0."},
    )
    aux_token_share: bool = field(
        default=False,
        metadata={
            "help": "Reference only: a MoE router's auxiliary loss of each completion weighted by its share of the "
            "step's non-padding tokens (the definition ODC trains it with, for microbatches of one completion)."
        },
    )


def stub_rollout(prompts: list[str], trainer: Any) -> dict[str, Any]:
    """Completions that depend on (prompt, copy index) only: reproducible across world sizes."""
    tokenizer = trainer.processing_class
    rank_offset = trainer.accelerator.process_index * len(prompts)
    groups = trainer.num_generations
    limit = int(trainer.max_completion_length)
    eos = int(tokenizer.eos_token_id)
    last = min(_LAST_TOKEN, eos)  # the offline tokenizer's ranks end at its EOS id (ODC_OFFLINE_BPE_RANKS)
    prompt_ids, completion_ids = [], []
    for i, prompt in enumerate(prompts):
        copy = (rank_offset + i) % groups  # groups of copies are contiguous over the global batch
        rng = np.random.default_rng(zlib.crc32(prompt.encode()) * 64 + copy)
        length = int(min(limit, 2 + rng.pareto(1.1) * 6))  # long-tailed: most short, a few up to the limit
        tokens = rng.integers(_FIRST_TOKEN, last, size=length - 1).tolist() + [eos]
        prompt_ids.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        completion_ids.append(tokens)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def fixed_slices_shuffle(ranks: int, slices: int) -> Any:
    """A stand-in for TRL's ``shuffle_sequence_dict`` (its shuffle of a rank's generation batch before it is split
    into ``slices`` slices) with a fixed permutation: the batch is read as ``ranks`` equal blocks (the generation
    batches of that many ranks, in rank order) and slice ``k`` takes the ``k``-th part of every block. With
    ``ranks=1`` (each rank of a multi-rank run) it keeps the order; on one process standing for ``ranks`` ranks, each
    slice (and so each optimizer step) holds the completions the ``k``-th slices of those ranks hold."""
    import torch

    def shuffle(batch: dict[str, Any]) -> dict[str, Any]:
        size = len(next(v for v in batch.values() if v is not None and getattr(v, "ndim", 1) > 0))
        block = size // ranks
        part = block // slices
        order = [r * block + k * part + i for k in range(slices) for r in range(ranks) for i in range(part)]
        assert sorted(order) == list(range(size)), (size, ranks, slices)
        index = torch.tensor(order)

        def permute(v: Any) -> Any:
            if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
                return v
            return v[index] if isinstance(v, torch.Tensor) else [v[i] for i in order]

        return {k: permute(v) for k, v in batch.items()}

    return shuffle


def use_fixed_slices(loop_args: Any, args: Any) -> None:
    """Put `fixed_slices_shuffle` (``loop_args.fixed_slices``) or TRL's own shuffle back in GRPO's and RLOO's
    trainer modules, where their ``_prepare_inputs`` (and the ODC trainers) look it up."""
    from trl.trainer import grpo_trainer, rloo_trainer, utils

    shuffle = utils.shuffle_sequence_dict
    if loop_args.fixed_slices:
        ranks = loop_args.reference_ranks if loop_args.reference else 1
        shuffle = fixed_slices_shuffle(ranks, int(args.steps_per_generation))
    grpo_trainer.shuffle_sequence_dict = rloo_trainer.shuffle_sequence_dict = shuffle


def extra_runs(spec: str | None) -> list[tuple[str, list[str]]]:
    """``--extra_runs`` as (folder, arguments) pairs."""
    runs = []
    for item in filter(None, (part.strip() for part in (spec or "").split(";"))):
        name, _, arguments = item.partition(":")
        runs.append((name.strip(), shlex.split(arguments)))
    return runs


def length_rule_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """A rule on the text: completions near 60 characters score best."""
    return [-abs(len(c) - 60) / 60.0 for c in completions]


def token_share_aux(trainer_cls: type) -> type:
    """``trainer_cls`` (TRL's GRPO or RLOO trainer, one process, the step as one microbatch) whose router auxiliary
    loss is the sum over the step's completions of each one's own term (a forward of that row alone) times its share
    of the step's non-padding tokens, instead of the term of the whole batch."""

    class TokenShareAux(trainer_cls):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kw):
            if not kw.get("compute_aux_loss"):
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, *args, **kw
                )
            import torch

            assert not args and all(
                v is None for k, v in kw.items() if k not in ("compute_entropy", "compute_aux_loss")
            )
            rows = [
                super(TokenShareAux, self)._get_per_token_logps_and_entropies(
                    model, input_ids[i : i + 1], attention_mask[i : i + 1], logits_to_keep, **kw
                )
                for i in range(input_ids.size(0))
            ]
            shares = attention_mask.sum(dim=1).float() / attention_mask.sum().float()
            aux = sum(share * row[2] for share, row in zip(shares, rows, strict=True))
            entropies = torch.cat([row[1] for row in rows]) if kw.get("compute_entropy") else None
            return torch.cat([row[0] for row in rows]), entropies, aux

    TokenShareAux.__name__ = TokenShareAux.__qualname__ = f"TokenShareAux{trainer_cls.__name__}"
    return TokenShareAux


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, set_seed
    from trl import GRPOConfig, GRPOTrainer, TrlParser

    from odc_accelerate.demo import load_offline_tokenizer, offline_texts, tiny_qwen2_config
    from odc_accelerate.integrations.trl import ODCGRPOConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    reference = "--reference" in argv and argv[argv.index("--reference") + 1].lower() == "true"
    parser = TrlParser((LoopArguments, GRPOConfig if reference else ODCGRPOConfig))
    loop_args, args = parser.parse_args_into_dataclasses(argv)
    tokenizer = load_offline_tokenizer()
    if loop_args.model_name_or_path:
        path = loop_args.model_name_or_path
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    else:
        set_seed(0)
        config = tiny_qwen2_config(hidden_size=32)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
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
        trainer_cls = token_share_aux(GRPOTrainer) if loop_args.aux_token_share else GRPOTrainer
    else:
        from odc_accelerate.integrations.trl import ODCGRPOTrainer

        trainer_cls = ODCGRPOTrainer
    loss_types = loop_args.loss_types.split(",") if loop_args.loss_types else [args.loss_type]
    # (loss type, extra arguments, output folder) of each training run, one after the other in this process group
    runs = [(["--loss_type", loss_type], loss_type) for loss_type in loss_types]
    if loop_args.kl_free_loss_types:
        runs += [(["--loss_type", t, "--beta", "0"], f"{t}_beta0") for t in loop_args.kl_free_loss_types.split(",")]
    runs += [(extra, folder) for folder, extra in extra_runs(loop_args.extra_runs)]
    root = args.output_dir
    for i, (extra, folder) in enumerate(runs):
        if len(runs) > 1:  # fresh arguments: a trainer may change its own (gradient accumulation); the last one wins
            loop_args, args = parser.parse_args_into_dataclasses(
                [*argv, *extra, "--output_dir", os.path.join(root, folder)]
            )
            args.model_init_kwargs = {"dtype": "float32", "attn_implementation": "sdpa"}
        use_fixed_slices(loop_args, args)
        trainer = trainer_cls(
            model=path,
            reward_funcs=length_rule_reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            rollout_func=stub_rollout if loop_args.stub_rollout else None,
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

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
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
            json.dump({"losses": losses, "log_history": trainer.state.log_history}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
