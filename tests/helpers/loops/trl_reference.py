"""The parity reference of the SFT and DPO tests: TRL's own trainer in one process, on the same optimizer steps.

    python tests/helpers/loops/trl_reference.py sft --samples_per_step 5 --output_dir OUT --max_steps 2 --seed 0 ...
        (any SFTConfig / DPOConfig / RewardConfig / KTOConfig argument; the first argument is sft, dpo, reward or kto)

It trains TRL's unmodified `SFTTrainer` / `DPOTrainer` (offline default model, tokenizer and data, built as the
examples build them; ``--model_name_or_path DIR``: the model saved there, as the scripts load it, a vision-language model with its processor;
SFT's ``--dataset_name DIR``: a local dataset folder; ``--one_microbatch``: each step as one microbatch, for a
model whose forward takes no loss keyword arguments, such as Qwen3-VL, with which TRL's gradient accumulation averages
the microbatches' token means instead of taking the step's token mean, the loss ODC trains) with ``per_device_train_batch_size=1`` and ``gradient_accumulation_steps=samples_per_step``, so
each optimizer step accumulates ``samples_per_step`` samples through TRL's own gradient accumulation and
normalisation. ``reward`` trains TRL's `RewardTrainer` (the offline default reward model: the tiny Qwen2 as a sequence
classifier with one output; the DPO pairs) with ``per_device_train_batch_size=samples_per_step`` and no accumulation:
the whole global batch is one microbatch, so TRL's metrics of a step (the minimum and maximum reward among them) are
those of the whole step. ``kto`` trains TRL's `KTOTrainer` (the offline default policy and a copy as its reference, the
DPO pairs, which TRL unpairs) the same way, the whole global batch as one microbatch, so that TRL's KL estimate ``z0``
is over every KL pair of the step, with the KL pairs of the ODC run: the completions rotated within blocks of the
run's ``per_device_train_batch_size``. Its data order is the one ODC's sampler draws steps from, written here from its definition: step
``k`` holds the ``k``-th run of ``samples_per_step`` samples of a permutation of the processed training set drawn
with numpy's PCG64 seeded by ``(seed, epoch)``. The only change to TRL's trainer is that it reads the training set in
that order (a sequential sampler), and with TRL 1.15 on CPU its fused LM head takes the torch path of TRL 1.16
(`odc_accelerate._compat.trl.lm_head.fused_lm_head_torch_path`; TRL 1.15's is a Triton kernel whatever the device).
``--aux_token_share``: a MoE router's auxiliary loss of each microbatch weighted by its share of the step's
non-padding tokens (the definition the ODC trainers train it with) instead of TRL's ``1 / gradient_accumulation_steps``;
for ``kto`` (the step as one microbatch), each example's own term weighted by its share (ODC's definition when each
microbatch holds one example).
``OUT`` gets what the parity tests read from ODC runs (`run_example.py` with
``ODC_DUMP_PARAMS=1``): ``initial_params.pt``, ``final_params.pt`` and ``trainer_state.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import numpy as np
import torch
from torch.utils.data import SequentialSampler
from transformers import AutoModelForCausalLM, set_seed


def _is_vlm(path: str | None) -> bool:
    """Whether ``path`` holds a vision-language model (`odc_accelerate.testing.models.save_tiny_vlm`)."""
    import json

    return path is not None and "vision_config" in json.loads(open(os.path.join(path, "config.json")).read())


def _model(seed: int, path: str | None = None) -> AutoModelForCausalLM:
    if _is_vlm(path):  # as TRL's SFTTrainer loads a vision-language model from its name
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    if path is not None:  # as the scripts load --model_name_or_path (TRL's default dtype for a path is float32)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    from odc_accelerate.demo import tiny_qwen2_config

    config = tiny_qwen2_config()
    set_seed(seed)  # as the examples: every model starts from the weights of this seed
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def _reward_model(seed: int, path: str | None = None):
    """The reward model the reward scripts train: the offline default (`odc_accelerate.testing.models.tiny_reward_model`,
    the model `odc_accelerate.scripts.reward` builds), or the model saved at ``path`` loaded as TRL's `RewardTrainer`
    loads a name (``num_labels=1``, float32)."""
    from transformers import AutoModelForSequenceClassification

    from odc_accelerate.testing.models import tiny_reward_model

    if path is not None:
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    return tiny_reward_model("untied", seed)


def _params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


def _in_step_order(dataset, samples_per_step: int, seed: int):
    order = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0]))).permutation(len(dataset))
    steps = len(dataset) // samples_per_step
    return dataset.select([int(i) for i in order[: steps * samples_per_step]])


def _kl_pairs_of_blocks(dataset, block: int):
    """KTO's KL completions as TRL pairs them for ``per_device_train_batch_size=block`` (`KTOTrainer._prepare_dataset`:
    the completions rotated by one within each block of ``block`` prepared rows), the ODC run's pairing."""

    def rotate(examples):
        examples["KL_completion_ids"] = [examples["completion_ids"][-1]] + examples["completion_ids"][:-1]
        return examples

    return dataset.map(rotate, batched=True, batch_size=block)


@contextlib.contextmanager
def _per_row_router_aux(model):
    """Within the block, a forward of ``model`` that returns a router auxiliary loss returns instead the sum over its
    rows of each row's own (a forward of that row alone) times the row's share of the batch's non-padding tokens."""
    forward, own = model.forward, "forward" in vars(model)  # TRL's fused LM head is an instance attribute

    def per_row(**kwargs):
        out = forward(**kwargs)
        if kwargs.get("output_router_logits") and getattr(out, "aux_loss", None) is not None:
            mask = kwargs["attention_mask"]
            rows = mask.size(0)
            sliced = [
                {
                    k: v[i : i + 1] if torch.is_tensor(v) and v.dim() and v.size(0) == rows else v
                    for k, v in kwargs.items()
                }
                for i in range(rows)
            ]
            shares = mask.sum(dim=1).float() / mask.sum().float()
            out.aux_loss = sum(share * forward(**row).aux_loss for share, row in zip(shares, sliced, strict=True))
        return out

    model.forward = per_row
    try:
        yield
    finally:
        if own:
            model.forward = forward
        else:
            del model.forward


def main(argv: list[str]) -> None:
    from transformers import HfArgumentParser
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer

    from odc_accelerate._compat.trl import lm_head as trl_lm_head
    from odc_accelerate.demo import load_offline_tokenizer, offline_dpo_dataset, offline_sft_dataset

    parser = argparse.ArgumentParser()
    parser.add_argument("trainer", choices=["sft", "dpo", "reward", "kto"])
    parser.add_argument("--samples_per_step", type=int, required=True)
    parser.add_argument("--model_name_or_path", default=None, help="a saved model and tokenizer (default: offline)")
    parser.add_argument("--dataset_name", default=None, help="SFT: a local dataset folder, as load_dataset reads it")
    parser.add_argument(
        "--one_microbatch",
        action="store_true",
        help="SFT: each optimizer step as one microbatch (a model whose forward takes no loss keyword arguments)",
    )
    parser.add_argument(
        "--aux_token_share",
        action="store_true",
        help="weight each microbatch's router auxiliary loss by its share of the step's non-padding tokens",
    )
    own, rest = parser.parse_known_args(argv)
    config_class, trainer_class = {
        "sft": (SFTConfig, SFTTrainer),
        "dpo": (DPOConfig, DPOTrainer),
        "reward": (RewardConfig, RewardTrainer),
        "kto": (KTOConfig, KTOTrainer),
    }[own.trainer]
    # fp32 unless asked (TRL defaults to bf16, which its argument checks refuse on CPU); a later --bf16 wins
    (args,) = HfArgumentParser(config_class).parse_args_into_dataclasses(["--bf16", "false", *rest])
    kl_block = args.per_device_train_batch_size  # the ODC run's: TRL's KL pairs are rotated within such blocks
    if own.trainer in ("reward", "kto") or own.one_microbatch:  # the global batch as one microbatch (see above)
        args.per_device_train_batch_size = own.samples_per_step
        args.gradient_accumulation_steps = 1
    else:
        args.per_device_train_batch_size = 1
        args.gradient_accumulation_steps = own.samples_per_step

    class InStepOrder(trainer_class):  # TRL's trainer; only the order in which it reads the training set is fixed
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

        if own.aux_token_share and own.trainer == "kto":
            # The step as one microbatch: its router term is each example's own term (a forward of that row alone)
            # weighted by its share of the step's non-padding tokens, ODC's definition with one example per microbatch.
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                with _per_row_router_aux(model) if model.training else contextlib.nullcontext():
                    return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        elif own.aux_token_share:
            # The definition ODC trains a router's auxiliary loss with, in one process: each microbatch's term weighted
            # by its share of the step's non-padding tokens instead of 1 / gradient_accumulation_steps.
            def get_batch_samples(self, epoch_iterator, num_batches, device):
                batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
                self.step_tokens = sum(int(b["attention_mask"].sum()) for b in batches)
                return batches, count

            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                coef = self.router_aux_loss_coef
                if model.training:  # TRL divides the term by the accumulation steps (SFT), or the Trainer does (DPO)
                    share = int(inputs["attention_mask"].sum()) / self.step_tokens
                    self.router_aux_loss_coef = coef * share * self.args.gradient_accumulation_steps
                try:
                    return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
                finally:
                    self.router_aux_loss_coef = coef

    tokenizer = load_offline_tokenizer()  # as saved beside a --model_name_or_path model (`save_tiny_causal_lm`)
    # TRL 1.15's fused LM head is a Triton kernel whatever the device: on CPU it takes the torch path TRL 1.16 has
    # (as the ODC trainers do; nothing changes on TRL 1.16)
    # (the reward model is a sequence classifier: no LM head)
    fused = contextlib.nullcontext() if own.trainer == "reward" else trl_lm_head.fused_lm_head_torch_path(own.trainer)
    with fused:
        if own.trainer == "reward":
            trainer = InStepOrder(
                model=_reward_model(args.seed, own.model_name_or_path),
                args=args,
                train_dataset=offline_dpo_dataset(),
                processing_class=tokenizer,
            )
        elif own.trainer == "sft":
            processing_class = tokenizer
            if _is_vlm(own.model_name_or_path):  # its processor, as TRL loads it (`save_tiny_vlm`)
                from transformers import AutoProcessor

                from odc_accelerate.testing.models import register_tiny_vlm_processor

                register_tiny_vlm_processor()
                processing_class = AutoProcessor.from_pretrained(own.model_name_or_path)
            if own.dataset_name is not None:
                from datasets import load_dataset

                train_dataset = load_dataset(own.dataset_name)["train"]
            else:
                train_dataset = offline_sft_dataset()
            trainer = InStepOrder(
                model=_model(args.seed, own.model_name_or_path),
                args=args,
                train_dataset=train_dataset,
                processing_class=processing_class,
            )
        elif own.trainer == "kto":
            policy, reference = (_model(args.seed, own.model_name_or_path) for _ in range(2))
            trainer = InStepOrder(
                model=policy,
                ref_model=reference,
                args=args,
                train_dataset=offline_dpo_dataset(),
                processing_class=tokenizer,
            )
            trainer.train_dataset = _kl_pairs_of_blocks(trainer.train_dataset, kl_block)
        else:
            policy, reference = (_model(args.seed, own.model_name_or_path) for _ in range(2))
            trainer = InStepOrder(
                model=policy,
                ref_model=reference,
                args=args,
                train_dataset=offline_dpo_dataset(),
                processing_class=tokenizer,
            )
    trainer.train_dataset = _in_step_order(trainer.train_dataset, own.samples_per_step, args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    torch.save(_params(trainer.model), os.path.join(args.output_dir, "initial_params.pt"))
    trainer.train()
    trainer.save_state()
    torch.save(_params(trainer.model), os.path.join(args.output_dir, "final_params.pt"))
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1:])
