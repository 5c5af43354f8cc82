"""A mixture-of-experts router's auxiliary loss under ODC's plans: when a trainer adds it, which tokens weight it,
and where it is refused; transformers' own expert parallelism, refused.

Under a plan the ODC SFT, DPO, KTO, GRPO and RLOO trainers and a plain Trainer's own loss weight each microbatch's
load-balancing term by its share of the step's routed tokens (`odc_accelerate.integrations.trainer.moe`; the
multiprocess tests check the updates); the other trainers refuse it in their set-up, naming the model and the setting
to change. Whether the loss is on is TRL's
decision (and, for `transformers.Trainer`, the model's own forward's): the tests compare with those.
"""

from __future__ import annotations

import inspect
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


@pytest.mark.parametrize("trainer", ["sft", "dpo", "grpo", "rloo", "kto"])
def test_odc_trainers_weight_it_in_their_set_up(tmp_path, trainer):
    """SFT, DPO, GRPO, RLOO and KTO weight the loss under a plan: their set-up goes on to the launch's refusal (one
    process, no FSDP), with TRL's coefficient as with ``router_aux_loss_coef=0``."""
    from odc_accelerate import ODCDPOConfig, ODCDPOTrainer, ODCSFTConfig, ODCSFTTrainer
    from odc_accelerate.demo import load_offline_tokenizer
    from odc_accelerate.integrations.trl import (
        ODCGRPOConfig,
        ODCGRPOTrainer,
        ODCKTOConfig,
        ODCKTOTrainer,
        ODCRLOOConfig,
        ODCRLOOTrainer,
    )

    config_class, trainer_class = {
        "sft": (ODCSFTConfig, ODCSFTTrainer),
        "dpo": (ODCDPOConfig, ODCDPOTrainer),
        "grpo": (ODCGRPOConfig, ODCGRPOTrainer),
        "rloo": (ODCRLOOConfig, ODCRLOOTrainer),
        "kto": (ODCKTOConfig, ODCKTOTrainer),
    }[trainer]
    online = trainer in ("grpo", "rloo")
    sizes = {"num_generations": 4, "per_device_train_batch_size": 4} if online else {}
    rewards = {"reward_funcs": lambda completions, **kwargs: [0.0] * len(completions)} if online else {}
    data = _dataset("dpo" if trainer == "kto" else trainer)
    no_fsdp = "ODC needs FSDP2, but this run does not use FSDP"
    for coef in (None, 0.0):
        args = config_class(
            output_dir=str(tmp_path), odc=True, router_aux_loss_coef=coef, report_to="none", bf16=False, **sizes
        )
        with pytest.raises(ValueError, match=re.escape(no_fsdp)):
            trainer_class(
                model=_model("moe"),
                args=args,
                train_dataset=data,
                processing_class=load_offline_tokenizer(),
                **rewards,
            )


def test_a_trainer_that_does_not_weight_it_is_refused_by_name():
    """What a trainer class that does not declare the weighting meets under a plan: the model, the coefficient, the
    trainer, the trainers that weight it and the setting to change."""
    from odc_accelerate.integrations.trainer.moe import check_router_aux_loss

    class OtherTrainer:
        pass

    args, config = SimpleNamespace(router_aux_loss_coef=None), SimpleNamespace(plan="free")
    with pytest.raises(ValueError) as refused:
        check_router_aux_loss(_model("moe"), args, config, OtherTrainer)
    message = str(refused.value)
    assert f"{MOE_AUX} (router_aux_loss_coef=0.001) once per microbatch, and OtherTrainer does not" in message
    assert "under the 'free' plan (ODCSFTTrainer, ODCDPOTrainer, ODCKTOTrainer, ODCGRPOTrainer" in message
    assert "Pass --router_aux_loss_coef 0 to train without it" in message
    check_router_aux_loss(_model("moe"), args, config, OtherTrainer, served=True)
    check_router_aux_loss(_model("moe"), SimpleNamespace(router_aux_loss_coef=0.0), config, OtherTrainer)


class _OwnLoss:
    """A plain Trainer subclass's own ``compute_loss`` (mixed in before `ODCTrainer`)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


@pytest.mark.parametrize("loss", ["trainer", "compute_loss_func", "subclass", "off"])
def test_a_plain_trainer_weights_its_own_loss_and_refuses_another_by_name(tmp_path, loss):
    """The plain Trainer's own ``compute_loss`` has the term the model's forward adds weighted (its set-up goes on to
    the launch's refusal); a ``compute_loss_func`` or a subclass's ``compute_loss`` computes a loss ODC cannot
    reweight: refused by name before any work, and not when the model's config leaves the term off."""
    from transformers import DataCollatorForLanguageModeling, TrainingArguments

    from odc_accelerate import ODCTrainer
    from odc_accelerate.demo import load_offline_tokenizer

    tokenizer = load_offline_tokenizer()
    model = _model("moe")
    model.config.output_router_logits = loss != "off"
    data = _dataset("sft").map(lambda row: tokenizer(row["text"]), remove_columns=["text"])
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to="none", fsdp_config={"odc": True, "odc_plan": "free"}, use_cpu=True
    )
    cls = type("MyTrainer", (_OwnLoss, ODCTrainer), {}) if loss == "subclass" else ODCTrainer
    func = {"compute_loss_func": lambda outputs, labels, num_items_in_batch=None: outputs.loss}
    with pytest.raises(ValueError) as refused:
        cls(
            model=model,
            args=args,
            train_dataset=data,
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
            **(func if loss == "compute_loss_func" else {}),
        )
    message = str(refused.value)
    if loss in ("trainer", "off"):
        assert "ODC needs FSDP2, but this run does not use FSDP" in message, message
        return
    named = "compute_loss_func" if loss == "compute_loss_func" else "_OwnLoss.compute_loss"
    assert f"{MOE_AUX} (router_aux_loss_coef=0.001) once per microbatch" in message, message
    assert f"MyTrainer's loss is computed by {named}" in message or f"ODCTrainer's loss is computed by {named}" in (
        message
    ), message
    assert "Load the model with output_router_logits=False to train without it" in message


def test_the_models_coefficient_is_scaled_only_inside_the_block():
    """What the plain Trainer's microbatches train: the forward's loss with ``factor`` times its router term."""
    from odc_accelerate._compat.transformers import scaled_router_aux_loss_coef

    model = _model("moe")
    model.config.output_router_logits = True
    coef = model.config.router_aux_loss_coef
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        nll = model(input_ids=ids, labels=ids, output_router_logits=False).loss
        out = model(input_ids=ids, labels=ids)
        with scaled_router_aux_loss_coef(model, 0.25):
            scaled = model(input_ids=ids, labels=ids).loss
        again = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(out.loss, nll + coef * out.aux_loss)
    torch.testing.assert_close(scaled, nll + 0.25 * coef * out.aux_loss)
    torch.testing.assert_close(again, out.loss)  # restored
    assert model.config.router_aux_loss_coef == coef


def test_routed_tokens_are_the_ones_the_router_statistics_average_over():
    """transformers' load-balancing loss leaves padding out with an attention mask, and counts every token of a packed
    row (no attention mask): the microbatch weights count the same tokens."""
    from odc_accelerate.integrations.trainer.moe import routed_tokens

    ids = torch.ones(2, 5, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert routed_tokens({"input_ids": ids, "attention_mask": mask}) == 8
    assert routed_tokens({"input_ids": ids.reshape(1, -1), "position_ids": torch.arange(10)[None]}) == 10
    model = _model("moe")
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
        # the same tokens without their padding: the statistics of the 8 routed tokens alone
        alone = model(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits
    routed = torch.cat([logits.reshape(2, 5, -1)[mask.bool()] for logits in alone])
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    cfg = model.config
    expected = load_balancing_loss_func((routed,), cfg.num_experts, cfg.num_experts_per_tok)
    torch.testing.assert_close(padded, expected)


def test_a_model_transformers_distributed_itself_is_refused_by_name():
    """``from_pretrained(..., distributed_config=DistributedConfig(...))`` with expert (or tensor / FSDP) parallelism
    makes transformers shard the model itself: refused, naming the settings and what to change."""
    from transformers.distributed import DistributedConfig

    from odc_accelerate.integrations.trainer.moe import check_transformers_distributed

    model = _model("moe")
    check_transformers_distributed(model)  # loaded without one: nothing to refuse
    model.config.distributed_config = DistributedConfig(tp_size=1)
    check_transformers_distributed(model)  # one that distributes nothing
    cases = [_expert_parallel_config()]
    if "ep_size" in inspect.signature(DistributedConfig).parameters:  # the older flag, deprecated there
        cases.append((DistributedConfig(enable_expert_parallel=True, tp_size=2), "ep_size=2, tp_size=2"))
    for config, named in cases:
        model.config.distributed_config = config
        with pytest.raises(ValueError, match=re.escape(f"distributed_config=DistributedConfig({named})")) as refused:
            check_transformers_distributed(model)
        assert "Qwen3MoeForCausalLM (qwen3_moe)" in str(refused.value)
        assert "Load the model without distributed_config" in str(refused.value)


def _expert_parallel_config() -> tuple:
    """transformers' expert parallelism over 2 ranks, and how the refusal names it: ``ep_size`` where the config has it
    (transformers 5.24), the older ``enable_expert_parallel`` flag otherwise (5.17)."""
    from transformers.distributed import DistributedConfig

    if "ep_size" in inspect.signature(DistributedConfig).parameters:
        return DistributedConfig(ep_size=2, fsdp_size=2, tp_size=1), "ep_size=2, fsdp_size=2"
    return DistributedConfig(enable_expert_parallel=True, tp_size=2), "tp_size=2, enable_expert_parallel=True"


def test_the_odc_trainers_refuse_a_model_transformers_distributed_before_the_accelerator(tmp_path):
    """The trainer's set-up refuses it with ODC on before anything is prepared (in one process the launch's refusal
    would come next, and does without the distributed config)."""

    from odc_accelerate import ODCSFTConfig, ODCSFTTrainer
    from odc_accelerate.demo import load_offline_tokenizer

    for distributed, match in (
        (_expert_parallel_config()[0], f"distributed_config=DistributedConfig({_expert_parallel_config()[1]}"),
        (None, "ODC needs FSDP2, but this run does not use FSDP"),
    ):
        model = _model("moe")
        model.config.distributed_config = distributed
        args = ODCSFTConfig(output_dir=str(tmp_path), odc=True, report_to="none", bf16=False)
        with pytest.raises(ValueError, match=re.escape(match)):
            ODCSFTTrainer(
                model=model, args=args, train_dataset=_dataset("sft"), processing_class=load_offline_tokenizer()
            )


def test_the_coefficient_is_scaled_by_the_microbatch_share_only_inside_its_loss():
    from odc_accelerate.integrations.trainer.step import ODCStepLoop

    trainer = ODCStepLoop()
    trainer.router_aux_loss_coef, trainer._odc_aux_share = 0.5, None
    with trainer._odc_router_coef(2.0):  # outside a planned microbatch: TRL's own coefficient
        assert trainer.router_aux_loss_coef == 0.5
    trainer._odc_aux_share = 0.25
    with pytest.raises(RuntimeError), trainer._odc_router_coef(2.0):
        assert trainer.router_aux_loss_coef == 0.5 * 0.25 * 2.0
        raise RuntimeError
    assert trainer.router_aux_loss_coef == 0.5  # restored, also after an error


def test_the_logged_aux_loss_is_the_share_weighted_sum_over_the_step():
    """Each microbatch's recorded aux_loss times its share of the step's routed tokens: the step's value is the sum
    (one process here; the sums of every rank in the step's one exchange)."""
    from odc_accelerate.integrations.trainer.metrics import DeferredGather, reduce_step_metrics

    deferred = DeferredGather()
    for aux, other, share in ((2.0, 7.0, 0.75), (3.0, 1.0, 0.25)):
        deferred.start_microbatch()
        deferred(torch.tensor(aux))
        deferred(torch.tensor(other))
        deferred.scale_call(0, share)
    metrics = reduce_step_metrics(deferred, None, "cpu")
    assert metrics.global_sums[0] == pytest.approx(2.0 * 0.75 + 3.0 * 0.25)
    assert metrics.global_sums[1] == 8.0  # the other gathers as they were


def test_a_collators_batch_encoding_counts_its_label_tokens_as_the_trainer_does():
    """`DataCollatorForLanguageModeling` returns a `BatchEncoding` (a mapping, not a dict): the Trainer counts its
    labels and passes ``num_items_in_batch``, so the plan's microbatches must too (else each microbatch's loss becomes a
    mean over its own tokens, and a MoE's router term is weighted as such)."""
    from transformers import DataCollatorForLanguageModeling

    from odc_accelerate._compat.transformers import counts_loss_items
    from odc_accelerate.demo import load_offline_tokenizer

    tokenizer = load_offline_tokenizer()
    batch = DataCollatorForLanguageModeling(tokenizer, mlm=False)([tokenizer("one two"), tokenizer("three")])
    trainer = SimpleNamespace(model_accepts_loss_kwargs=True, compute_loss_func=None)
    assert not isinstance(batch, dict) and counts_loss_items(trainer, batch)
    assert not counts_loss_items(trainer, {k: v for k, v in batch.items() if k != "labels"})
    assert not counts_loss_items(SimpleNamespace(model_accepts_loss_kwargs=False, compute_loss_func=None), batch)
