"""A mixture-of-experts router's auxiliary loss under ODC's plans: when a trainer adds it, and its refusal.

The load-balancing loss is a function of a whole microbatch, so no plan can make it exact: the ODC trainers refuse it
in their set-up, naming the model and the setting to change
(`odc_accelerate.integrations.trainer.setup.check_router_aux_loss`). Whether the loss is on is TRL's decision (and,
for `transformers.Trainer`, the model's own forward's): the tests compare with those.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from odc_accelerate.integrations.trainer.setup import router_aux_loss_coef

MOE_AUX = "Qwen3MoeForCausalLM (qwen3_moe) adds its router's auxiliary load-balancing loss"


def _model(kind: str):
    from transformers import AutoModelForCausalLM, set_seed

    from odc_accelerate.testing.models import tiny_causal_lm_config

    set_seed(0)
    return AutoModelForCausalLM.from_config(tiny_causal_lm_config(kind, hidden_size=16), dtype=torch.float32)


def _dataset(trainer: str):
    from datasets import Dataset

    if trainer == "sft":
        return Dataset.from_dict({"text": ["one two three four"] * 4})
    if trainer == "dpo":
        return Dataset.from_dict({"prompt": ["one two"] * 4, "chosen": [" three"] * 4, "rejected": [" four"] * 4})
    return Dataset.from_dict({"prompt": ["one two three"] * 8})


@pytest.mark.parametrize(("kind", "coef"), [("tied", None), ("tied", 0.0), ("moe", None), ("moe", 0.0), ("moe", 0.01)])
def test_the_coefficient_is_the_one_trls_trainer_adds(tmp_path, kind, coef):
    from trl import SFTConfig, SFTTrainer

    from odc_accelerate.demo import load_offline_tokenizer

    model = _model(kind)
    args = SFTConfig(output_dir=str(tmp_path), router_aux_loss_coef=coef, report_to="none", bf16=False)
    ours = router_aux_loss_coef(model, args)  # before TRL writes its decision into the model's config
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=_dataset("sft"), processing_class=load_offline_tokenizer()
    )
    assert ours == (trainer.router_aux_loss_coef if trainer.aux_loss_enabled else 0.0)
    assert (ours != 0.0) == (kind == "moe" and coef != 0.0)  # on for the MoE unless 0: TRL's default


@pytest.mark.parametrize("output_router_logits", [False, True])
def test_without_trl_the_coefficient_is_the_one_the_models_forward_adds(output_router_logits):
    from transformers import TrainingArguments

    model = _model("moe")
    model.config.output_router_logits = output_router_logits
    coef = router_aux_loss_coef(model, TrainingArguments(output_dir="unused", report_to="none"))
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids, output_router_logits=True)  # the aux loss itself, whatever the config
        nll = model(input_ids=ids, labels=ids, output_router_logits=False).loss
        loss = model(input_ids=ids, labels=ids).loss  # what transformers.Trainer trains: the config decides
    assert coef == (model.config.router_aux_loss_coef if output_router_logits else 0.0)
    torch.testing.assert_close(loss, nll + coef * out.aux_loss)


def test_a_dense_model_or_no_model_has_none():
    args = SimpleNamespace(router_aux_loss_coef=None)
    assert router_aux_loss_coef(_model("untied"), args) == 0.0
    assert router_aux_loss_coef(None, args) == 0.0


@pytest.mark.parametrize("trainer", ["sft", "dpo", "grpo"])
def test_odc_trainers_refuse_it_in_their_set_up_naming_model_and_fix(tmp_path, trainer):
    """Refused before the accelerator exists: in one process the refusal of the launch (no FSDP) would come next, and
    with ``router_aux_loss_coef=0`` it does."""
    from odc_accelerate import ODCDPOConfig, ODCDPOTrainer, ODCSFTConfig, ODCSFTTrainer
    from odc_accelerate.demo import load_offline_tokenizer
    from odc_accelerate.integrations.trl import ODCGRPOConfig, ODCGRPOTrainer

    config_class, trainer_class = {
        "sft": (ODCSFTConfig, ODCSFTTrainer),
        "dpo": (ODCDPOConfig, ODCDPOTrainer),
        "grpo": (ODCGRPOConfig, ODCGRPOTrainer),
    }[trainer]
    sizes = {"num_generations": 4, "per_device_train_batch_size": 4} if trainer == "grpo" else {}
    rewards = {"reward_funcs": lambda completions, **kwargs: [0.0] * len(completions)} if trainer == "grpo" else {}
    for coef, match in ((None, MOE_AUX), (0.0, "ODC needs FSDP2, but this run does not use FSDP")):
        args = config_class(
            output_dir=str(tmp_path), odc=True, router_aux_loss_coef=coef, report_to="none", bf16=False, **sizes
        )
        with pytest.raises(ValueError, match=re.escape(match)) as refused:
            trainer_class(
                model=_model("moe"),
                args=args,
                train_dataset=_dataset(trainer),
                processing_class=load_offline_tokenizer(),
                **rewards,
            )
        if coef is None:  # the coefficient TRL would use, and what to change
            assert "(router_aux_loss_coef=0.001) once per microbatch" in str(refused.value)
            assert "Pass --router_aux_loss_coef 0 to train without it" in str(refused.value)
