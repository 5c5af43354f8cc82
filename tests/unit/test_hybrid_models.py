"""Hybrid linear-attention models (Qwen3.5 / Qwen3.6 shape): FSDP2 wrap classes, recurrent-layer detection, packed
sequences, and the cost model's attention term per layer kind."""

from __future__ import annotations

import logging

import pytest
import torch


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


def test_transformer_based_wrap_wraps_the_layer_classes_the_model_has(hybrid_model, caplog):
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    from odc_accelerate._compat import accelerate as acompat

    # transformers lists the vision block of the multimodal model in the text-only model's _no_split_modules
    assert "Qwen3_5MoeVisionBlock" in hybrid_model._no_split_modules
    plugin = _plugin()
    with pytest.raises(ValueError, match="Could not find the transformer layer class Qwen3_5MoeVisionBlock"):
        fsdp2_prepare_auto_wrap_policy(plugin, hybrid_model)  # accelerate alone
    acompat._DROPPED_LOGGED.clear()
    with caplog.at_level(logging.WARNING, logger=acompat.__name__):
        for _ in range(2):  # a policy and its reference: said once
            with acompat._present_layer_classes(_Accelerator(plugin), hybrid_model):
                policy = fsdp2_prepare_auto_wrap_policy(plugin, hybrid_model)
            assert plugin.transformer_cls_names_to_wrap is None  # the next model gets its own classes
    wrapped = [name for name, module in hybrid_model.named_modules() if policy(module)]
    assert wrapped == [f"model.layers.{i}" for i in range(4)]
    said = [r.getMessage() for r in caplog.records if "_no_split_modules" in r.getMessage()]
    assert len(said) == 1 and "Qwen3_5MoeVisionBlock" in said[0] and "Qwen3_5MoeDecoderLayer" in said[0]


def test_a_layer_class_the_user_named_is_left_to_accelerate(hybrid_model):
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    from odc_accelerate._compat import accelerate as acompat

    plugin = _plugin(transformer_cls_names_to_wrap=["Qwen3_5MoeVisionBlock"])
    with acompat._present_layer_classes(_Accelerator(plugin), hybrid_model):
        with pytest.raises(ValueError, match="Could not find the transformer layer class Qwen3_5MoeVisionBlock"):
            fsdp2_prepare_auto_wrap_policy(plugin, hybrid_model)
    assert plugin.transformer_cls_names_to_wrap == ["Qwen3_5MoeVisionBlock"]
