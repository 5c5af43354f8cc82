"""The vLLM sync's weights for a PEFT model (`odc_accelerate.integrations.vllm.iter_full_parameters`): LoRA adapters
trained with ODC on 2 gloo ranks are merged into the weights of the model they wrap, as PEFT's own
``merge_and_unload`` merges them in one process. vLLM itself is not needed: its tests (tests/vllm) load these tensors."""

from __future__ import annotations

import pytest
import torch

from odc_accelerate.integrations.vllm import check_vllm_sync_model
from odc_accelerate.testing import launch
from tests.helpers.workers.peft_workers import merged_full_parameters, tiny_lora_model


def test_lora_weights_are_merged_as_peft_merges_them():
    results = launch(merged_full_parameters, 2, {}, timeout=300)
    for r in results:
        r["merged"] = {k: torch.from_numpy(v) for k, v in r["merged"].items()}
        r["full"] = {k: torch.from_numpy(v) for k, v in r["full"].items()}
    # The reference: a one-process PEFT model holding the trained parameters (DTensor's gather), merged by PEFT.
    reference = tiny_lora_model(seed=0)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(results[0]["full"][name])
    lora_b = [t for name, t in results[0]["full"].items() if ".lora_B." in name]
    assert lora_b and all(t.abs().sum() > 0 for t in lora_b)  # the step moved B off zero: the merge changes weights
    unloaded = reference.merge_and_unload()
    expected = dict(unloaded.named_parameters())
    for rank, r in enumerate(results):
        merged = r["merged"]
        assert sorted(merged) == sorted(expected), f"rank {rank}"
        for name, tensor in merged.items():
            assert torch.equal(tensor, expected[name]), f"rank {rank}: {name}"
        base = {n.replace("base_model.model.", "").replace(".base_layer", ""): t for n, t in r["full"].items()}
        assert not torch.equal(
            merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
        )
        assert r["stats"]["parameters"] == len(merged)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_dora": True}, "uses DoRA"),
        ({"lora_bias": True}, "LoRA bias"),
        ({"target_modules": ["embed_tokens"]}, "LoRA on an embedding"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        # aLoRA: a LoRA variant (``lora_variant``), which PEFT merges by its own rule
        ({"alora_invocation_tokens": [5, 6]}, "the LoRA variant ALoraLinearVariant"),
        # LoRA on a bare parameter (target_parameters): PEFT's ParamWrapper, not a linear layer
        ({"target_modules": [], "target_parameters": ["mlp.up_proj.weight"]}, "ParamWrapper layer"),
    ],
)
def test_adapters_the_sync_cannot_merge_are_refused_by_name(change, message):
    """Refused from the model alone (`check_vllm_sync_model`: before any engine is built), naming the layer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from odc_accelerate.demo import tiny_qwen2_config
    from tests.helpers.workers.peft_workers import LORA

    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(hidden_size=32))
    model = get_peft_model(model, LoraConfig(**{**LORA, **change}))
    with pytest.raises(NotImplementedError, match=message) as err:
        check_vllm_sync_model(model)
    assert str(err.value).startswith("base_model.model.")  # names the layer or parameter


def test_plain_lora_tied_and_dense_models_pass_the_set_up_check():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from odc_accelerate.testing.models import tiny_causal_lm_config
    from tests.helpers.workers.peft_workers import LORA

    for kind in ("untied", "tied"):
        model = AutoModelForCausalLM.from_config(tiny_causal_lm_config(kind, hidden_size=32))
        check_vllm_sync_model(model)
        check_vllm_sync_model(get_peft_model(model, LoraConfig(**LORA)))


def test_mixture_of_experts_models_pass_the_model_check():
    """A MoE model passes: its sync is checked end to end in tests/vllm (vLLM's CPU backend made to lay its experts
    out again)."""
    from transformers import AutoModelForCausalLM

    from odc_accelerate.testing.models import tiny_causal_lm_config

    model = AutoModelForCausalLM.from_config(tiny_causal_lm_config("moe", hidden_size=32))
    check_vllm_sync_model(model)
