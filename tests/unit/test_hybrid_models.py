"""Hybrid linear-attention models (Qwen3.5 / Qwen3.6 shape): FSDP2 wrap classes, recurrent-layer detection, packed
sequences, and the cost model's attention term per layer kind."""

from __future__ import annotations

import logging
import types

import accelerate
import pytest
import torch

from odc_accelerate._compat import version_tuple
from tests.conftest import requires_hf_current


@pytest.fixture(scope="module")
def hybrid_model():
    from transformers import AutoModelForCausalLM, set_seed

    from odc_accelerate.testing.models import tiny_causal_lm_config

    set_seed(0)
    return AutoModelForCausalLM.from_config(tiny_causal_lm_config("hybrid", hidden_size=32), dtype=torch.float32)


class _State:
    def __init__(self, plugin):
        self.fsdp_plugin = plugin


class _Accelerator:
    def __init__(self, plugin):
        self.state = _State(plugin)


def _plugin(**kwargs):
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP", **kwargs)


def _original_set_auto_wrap_policy():
    """accelerate's own method, whether or not an earlier test installed the package's patches (which wrap it)."""
    import inspect

    from accelerate.utils import FullyShardedDataParallelPlugin

    return inspect.unwrap(FullyShardedDataParallelPlugin.set_auto_wrap_policy)


def test_transformer_based_wrap_wraps_the_layer_classes_the_model_has(hybrid_model, caplog):
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    from odc_accelerate._compat import accelerate as acompat

    # transformers lists the vision block of the multimodal model in the text-only model's _no_split_modules
    original = _original_set_auto_wrap_policy()
    layers = [f"model.layers.{i}" for i in range(4)]
    if version_tuple(accelerate.__version__) < (1, 16):
        with pytest.raises(ValueError, match="Could not find the transformer layer class Qwen3_5MoeVisionBlock"):
            original(_plugin(), hybrid_model)  # accelerate alone (Accelerator._prepare_fsdp2's first call)
        with pytest.raises(ValueError, match="Could not find the transformer layer class Qwen3_5MoeVisionBlock"):
            fsdp2_prepare_auto_wrap_policy(_plugin(), hybrid_model)  # and fsdp2_prepare_model's
    else:  # accelerate 1.16 drops the names the model lacks itself (silently), with the same layers wrapped
        original(_plugin(), hybrid_model)
        alone = fsdp2_prepare_auto_wrap_policy(_plugin(), hybrid_model)
        assert [name for name, module in hybrid_model.named_modules() if alone(module)] == layers
    set_policy = acompat._wrap_set_auto_wrap_policy(original)
    plugin = _plugin()
    acompat._DROPPED_LOGGED.clear()
    with caplog.at_level(logging.WARNING, logger=acompat.__name__):
        for _ in range(2):  # a policy and its reference, in accelerate's order of calls: said once
            set_policy(plugin, hybrid_model)  # Accelerator._prepare_fsdp2
            with acompat._present_layer_classes(_Accelerator(plugin), hybrid_model):  # fsdp2_prepare_model
                set_policy(plugin, hybrid_model)
                policy = fsdp2_prepare_auto_wrap_policy(plugin, hybrid_model)
            assert plugin.transformer_cls_names_to_wrap is None  # the next model gets its own classes
    wrapped = [name for name, module in hybrid_model.named_modules() if policy(module)]
    assert wrapped == layers
    said = [r.getMessage() for r in caplog.records if "_no_split_modules" in r.getMessage()]
    assert len(said) == 1 and "Qwen3_5MoeVisionBlock" in said[0] and "Qwen3_5MoeDecoderLayer" in said[0]


def test_a_layer_class_the_user_named_is_left_to_accelerate(hybrid_model):
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    from odc_accelerate._compat import accelerate as acompat

    plugin = _plugin(transformer_cls_names_to_wrap=["Qwen3_5MoeVisionBlock"])
    set_policy = acompat._wrap_set_auto_wrap_policy(_original_set_auto_wrap_policy())
    with pytest.raises(ValueError, match="Could not find the transformer layer class Qwen3_5MoeVisionBlock"):
        set_policy(plugin, hybrid_model)
    with acompat._present_layer_classes(_Accelerator(plugin), hybrid_model):
        with pytest.raises(ValueError, match="Could not find the transformer layer class Qwen3_5MoeVisionBlock"):
            fsdp2_prepare_auto_wrap_policy(plugin, hybrid_model)
    assert plugin.transformer_cls_names_to_wrap == ["Qwen3_5MoeVisionBlock"]


# ------------------------------------------------------------------------------------------ recurrent-layer detection
def test_models_with_recurrent_layers_are_told_from_attention_only_ones():
    from transformers import JambaConfig, Qwen2Config, Qwen3_5MoeConfig, Qwen3MoeConfig, RecurrentGemmaConfig

    from odc_accelerate.hybrid import layer_kinds, recurrent_model
    from odc_accelerate.testing.models import tiny_causal_lm_config

    hybrid = tiny_causal_lm_config("hybrid", hidden_size=32)
    assert layer_kinds(hybrid) == ["linear_attention"] * 3 + ["full_attention"]
    assert recurrent_model(hybrid)
    vlm = Qwen3_5MoeConfig(text_config=hybrid.to_dict())  # with vision: its text config decides
    assert recurrent_model(vlm)
    assert recurrent_model(JambaConfig(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1))  # mamba
    assert recurrent_model(RecurrentGemmaConfig(num_hidden_layers=4))
    pattern = {"block_types": ["recurrent", "recurrent", "attention"], "num_hidden_layers": 4}  # older configs
    assert layer_kinds(pattern) == ["recurrent", "recurrent", "attention", "recurrent"] and recurrent_model(pattern)
    assert recurrent_model({"model_type": "mamba2"})
    sliding = Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    for config in (Qwen2Config(), sliding, Qwen3MoeConfig(), tiny_causal_lm_config("tied", hidden_size=32)):
        assert not recurrent_model(config), config.model_type


def test_the_kernels_named_are_those_the_model_needs(hybrid_model, monkeypatch):
    from odc_accelerate import hybrid

    monkeypatch.setattr(hybrid, "_installed", lambda name: False)
    assert hybrid.missing_packing_kernels(hybrid_model) == ["flash-linear-attention", "causal-conv1d"]
    monkeypatch.setattr(hybrid, "_installed", lambda name: name == "fla")
    assert hybrid.missing_packing_kernels(hybrid_model) == ["causal-conv1d"]
    monkeypatch.setattr(hybrid, "_installed", lambda name: False)
    assert hybrid.missing_packing_kernels(hybrid_model.config) == ["flash-linear-attention", "causal-conv1d"]
    monkeypatch.setattr(hybrid, "_installed", lambda name: True)
    assert hybrid.missing_packing_kernels(hybrid_model) == []
    assert hybrid.packing_refusal(hybrid_model, "--padding_free true", "x") is None


# ----------------------------------------------------------------------------------------------- packed sequences
def _samples(lengths=(40, 24), seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 8000, (n,), generator=gen).tolist()} for n in lengths]


def _own_logits(model, samples):
    with torch.no_grad():
        return [model(input_ids=torch.tensor([s["input_ids"]])).logits[0] for s in samples]


@requires_hf_current
def test_packing_by_position_ids_alone_leaks_across_samples_and_padded_rows_do_not(hybrid_model):
    """Why a recurrent model is planned padded without the kernels: DataCollatorWithFlattening's row (position ids
    restarting at 0) keeps the first sample exact and lets the recurrent state into the second; its boundaries make
    transformers' fallback raise; `PaddedRows` of the same collator give each sample its own forward."""
    from transformers import DataCollatorWithFlattening

    from odc_accelerate.hybrid import with_sequence_boundaries
    from odc_accelerate.integrations.trainer.data import PaddedRows

    samples = _samples()
    own = _own_logits(hybrid_model, samples)
    flat = DataCollatorWithFlattening()
    packed = flat(samples)
    with torch.no_grad():
        logits = hybrid_model(**packed).logits[0]
    first, second = (logits[:40] - own[0]).abs().max(), (logits[40:] - own[1]).abs().max()
    assert first < 1e-5 and second > 1e-2, (first, second)  # measured: 1.8e-7 and 0.3
    with pytest.raises(ValueError, match="can't keep packed sequences apart without"):
        with torch.no_grad():
            hybrid_model(**with_sequence_boundaries(packed))
    rows = PaddedRows(flat)(samples)
    assert rows["input_ids"].shape == (2, 40) and rows["attention_mask"].sum() == 64
    assert int((rows["labels"] != -100).sum()) == int((packed["labels"] != -100).sum())  # the same loss items
    with torch.no_grad():
        padded = hybrid_model(**rows).logits
    assert (padded[0] - own[0]).abs().max() < 1e-5
    assert (padded[1, :24] - own[1]).abs().max() < 1e-5


@requires_hf_current
def test_sequence_boundaries_are_those_trl_passes():
    from transformers import DataCollatorWithFlattening
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from odc_accelerate.hybrid import with_sequence_boundaries

    samples = _samples((5, 3, 4))
    ours = with_sequence_boundaries(DataCollatorWithFlattening()(samples))
    trl = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(samples)
    for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"):
        assert torch.equal(torch.as_tensor(ours[key]), torch.as_tensor(trl[key])), key


class _Loaders:
    """What `ODCStepLoaders._odc_collator` and `_odc_padded` read of a trainer."""

    def __init__(self, model, collator):
        from types import SimpleNamespace

        self.model, self.data_collator, self.args = model, collator, SimpleNamespace()


def _loaders(model, collator):
    from odc_accelerate.integrations.trainer.loaders import ODCStepLoaders

    cls = type("Trainer", (_Loaders, ODCStepLoaders), {})
    return cls(model, collator)


def test_a_plain_trainer_packing_a_recurrent_model_is_planned_padded_without_the_kernels(hybrid_model, monkeypatch):
    from transformers import AutoModelForCausalLM, DataCollatorWithFlattening

    from odc_accelerate import hybrid
    from odc_accelerate.integrations.trainer.data import PaddedRows, SequenceBoundaries
    from odc_accelerate.testing.models import tiny_causal_lm_config

    flat = DataCollatorWithFlattening()
    monkeypatch.setattr(hybrid, "_installed", lambda name: False)
    trainer = _loaders(hybrid_model, flat)
    assert isinstance(trainer._odc_collator(), PaddedRows) and trainer._odc_padded()
    monkeypatch.setattr(hybrid, "_installed", lambda name: True)  # where the kernels are: packed, with boundaries
    trainer = _loaders(hybrid_model, flat)
    assert isinstance(trainer._odc_collator(), SequenceBoundaries) and not trainer._odc_padded()
    assert "seq_idx" in trainer._odc_collator()(_samples())
    dense = AutoModelForCausalLM.from_config(tiny_causal_lm_config("tied", hidden_size=16))
    trainer = _loaders(dense, flat)
    assert trainer._odc_collator() is flat and not trainer._odc_padded()


def _sft_trainer(tmp_path, model, **kwargs):
    from datasets import Dataset

    from odc_accelerate import ODCSFTConfig, ODCSFTTrainer
    from odc_accelerate.demo import load_offline_tokenizer

    args = ODCSFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_length=24,
        report_to="none",
        bf16=False,
        odc=False,
        odc_plan="free",
        odc_samples_per_step=2,
        router_aux_loss_coef=0.0,  # refused under a plan (its own check), not what these tests are about
        **kwargs,
    )
    return ODCSFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"text": ["one two three four five six", "seven eight"] * 2}),
        processing_class=load_offline_tokenizer(),
    )


@pytest.mark.parametrize(
    ("options", "named"),
    [({"padding_free": True}, "--padding_free true"), ({"packing": True}, "--packing true (strategy bfd)")],
)
def test_padding_free_sft_of_a_recurrent_model_is_refused_at_set_up_naming_what_to_install(
    tmp_path, hybrid_model, monkeypatch, options, named
):
    from odc_accelerate import hybrid

    monkeypatch.setattr(hybrid, "_installed", lambda name: False)  # as on this CPU machine
    with pytest.raises(ValueError) as info:
        _sft_trainer(tmp_path, hybrid_model, **options)
    message = str(info.value)
    assert named in message and "pip install flash-linear-attention causal-conv1d" in message, message
    assert "linear_attention" in message and ("--packing false" in message or "--padding_free false" in message)


def test_default_sft_of_a_recurrent_model_plans_padded_rows(tmp_path, hybrid_model):
    trainer = _sft_trainer(tmp_path, hybrid_model)
    assert trainer._odc_padded()
    step = next(iter(trainer.get_train_dataloader()))
    assert all("attention_mask" in mb and "seq_idx" not in mb for mb in step)


def test_the_trainers_plan_charges_each_sample_what_the_models_config_says(tmp_path, hybrid_model, monkeypatch):
    """The Trainer's plan costs samples by this model's config (attention's L^2 on its one full-attention layer of 4),
    not by the published dense 7B fit; a config the cost model cannot read plans with that fit."""
    import numpy as np

    from odc_accelerate.planning import PUBLISHED_7B_COST, cost_from_config

    trainer = _sft_trainer(tmp_path, hybrid_model)
    trainer.get_train_dataloader()
    sampler, expected = trainer._odc_sampler, cost_from_config(hybrid_model.config)
    assert trainer._odc_plan_cost() == expected and expected != PUBLISHED_7B_COST
    np.testing.assert_allclose(sampler.costs, expected(sampler.lengths), rtol=1e-12)  # one padded row per sample
    # A custom model's config without the usual names: nothing cost_from_config can read.
    monkeypatch.setattr(hybrid_model, "config", types.SimpleNamespace(model_type="custom", num_layers=4))
    assert trainer._odc_plan_cost() is PUBLISHED_7B_COST


# ---------------------------------------------------------------------------------------------------- cost model
def test_the_attention_term_is_charged_on_full_attention_layers_only():
    import numpy as np

    from odc_accelerate.planning import cost_from_config, flops_cost
    from odc_accelerate.testing.models import tiny_causal_lm_config

    hybrid = tiny_causal_lm_config("hybrid", hidden_size=64)
    full = hybrid.to_dict() | {"layer_types": ["full_attention"] * 4}
    ours, every_layer = cost_from_config(hybrid), cost_from_config(full)
    d_q = hybrid.num_attention_heads * hybrid.head_dim
    assert ours.quadratic == 3 * 2 * d_q * 1 and every_layer.quadratic == 3 * 2 * d_q * 4  # 1 of 4 layers
    # Gated DeltaNet's own per-token work replaces the attention projections in the linear term.
    projections = 2 * 64 * d_q + 2 * 2 * 64 * 2 * 16 + 2 * d_q * 64
    assert ours.linear != every_layer.linear
    assert ours.linear - every_layer.linear == 3 * 3 * (_delta_net_flops(hybrid) - projections)
    # A config without layer_types is all full attention, as before.
    assert cost_from_config({k: v for k, v in full.items() if k != "layer_types"}) == every_layer
    with pytest.raises(ValueError, match="3 `layer_types` for 4 layers"):
        flops_cost(4, 64, 64, 4, layer_types=["full_attention"] * 3)
    assert ours(100) > every_layer(100) and ours(10000) < every_layer(10000)  # a recurrent layer's linear cost
    assert np.isclose(every_layer(np.array([10000]))[0], every_layer(10000))


def _delta_net_flops(config):
    h, nk, nv = config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv, kernel = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim
    keys, values = nk * dk, nv * dv
    projections = 2 * h * (2 * keys + values) + 2 * h * values + 2 * 2 * h * nv + 2 * values * h
    return projections + 2 * kernel * (2 * keys + values) + nv * (2 * 64 * (dk + dv) + 6 * dk * dv)


def test_sliding_window_layers_cost_quadratically_up_to_their_window_only():
    import numpy as np
    from transformers import Qwen2Config

    from odc_accelerate.planning import QuadraticCost, cost_from_config

    config = Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=128, max_window_layers=2, hidden_size=64,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
    )  # fmt: skip
    assert config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    cost = cost_from_config(config)
    full = cost_from_config(config.to_dict() | {"layer_types": ["full_attention"] * 4})
    assert cost.quadratic == full.quadratic / 2 and cost.windows == ((128, full.quadratic / 2),)
    short = np.array([1, 64, 128])
    np.testing.assert_allclose(cost(short), full(short))  # within the window every layer sees every key
    window_part = QuadraticCost(0.0, 0.0, windows=cost.windows)
    long = np.array([128, 256, 1024])
    np.testing.assert_allclose(window_part(long), cost.windows[0][1] * (2 * 128 * long - 128**2))  # linear beyond
    with pytest.raises(ValueError, match="windows >= 1"):
        QuadraticCost(1.0, 0.0, windows=((0, 1.0),))
