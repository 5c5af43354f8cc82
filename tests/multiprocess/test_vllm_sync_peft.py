"""The vLLM sync's weights for a PEFT model (`odc_accelerate.integrations.vllm.iter_full_parameters`): adapters
(plain LoRA, DoRA, a LoRA bias, ``modules_to_save``) trained with ODC on 2 gloo ranks are merged into the weights of
the model they wrap, as PEFT's own ``merge_and_unload`` merges them in one process. vLLM itself is not needed: its tests (tests/vllm) load these tensors."""

from __future__ import annotations

import pytest
import torch

from odc_accelerate.integrations.vllm import check_vllm_sync_model
from odc_accelerate.testing import launch
from tests.helpers.workers.peft_workers import SYNC_CASES, TIED_CASE, merged_full_parameters, tiny_lora_model


@pytest.fixture(scope="module")
def synced():
    """Every case of `SYNC_CASES`, trained and read on 2 ranks in one launch."""
    results = launch(merged_full_parameters, 2, {}, timeout=300)
    for r in results:
        for case in r.values():
            case["merged"] = {k: torch.from_numpy(v) for k, v in case["merged"].items()}
            case["full"] = {k: torch.from_numpy(v) for k, v in case["full"].items()}
    return results


# Per case, a merged weight that the adapters change, and the tensor of the trained PEFT model it started from.
_CHANGED = {
    "plain": ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.base_layer.weight"),
    "dora": ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.base_layer.weight"),
    "lora_bias": ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_proj.base_layer.bias"),
    "modules_to_save": ("lm_head.weight", "lm_head.original_module.weight"),
}


@pytest.mark.parametrize("case", list(SYNC_CASES))
def test_adapters_are_merged_as_peft_merges_them(synced, case):
    """Plain LoRA, DoRA (its norm per output row of the full weight), a LoRA bias and ``modules_to_save`` (the trained
    copy under the module's name): the sync's merged weights on each rank equal PEFT's own ``merge_and_unload``."""
    results = [r[case] for r in synced]
    # The reference: a one-process PEFT model holding the trained parameters (DTensor's gather), merged by PEFT.
    reference = tiny_lora_model(seed=0, change=SYNC_CASES[case])
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(results[0]["full"][name])
    lora_b = [t for name, t in results[0]["full"].items() if ".lora_B." in name]
    assert lora_b and all(t.abs().sum() > 0 for t in lora_b)  # the step moved B off zero: the merge changes weights
    unloaded = reference.merge_and_unload()
    expected = dict(unloaded.named_parameters())
    served, before = _CHANGED[case]
    for rank, r in enumerate(results):
        merged = r["merged"]
        assert sorted(merged) == sorted(expected), f"rank {rank}"
        for name, tensor in merged.items():
            assert torch.equal(tensor, expected[name]), f"rank {rank}: {name}"
        assert not torch.equal(merged[served], r["full"]["base_model.model." + before])
        assert r["stats"]["parameters"] == len(merged)


def test_a_tied_copy_syncs_under_both_names(synced):
    """A tied model trained with one tied ``modules_to_save`` copy of its embedding (``ensure_weight_tying``): read as
    a checkpoint stores it, the trained copy goes out as the embedding and as the LM head (the tie's other name, which
    vLLM's in-place reload needs), the original dropped; the rest equal PEFT's ``merge_and_unload``."""
    results = [r["tied"] for r in synced]
    reference = tiny_lora_model(seed=0, change=TIED_CASE, kind="tied")
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(results[0]["full"][name])
    expected = reference.merge_and_unload().state_dict()  # a tied weight under each of its names
    trained = results[0]["full"]["base_model.model.model.embed_tokens.modules_to_save.default.weight"]
    original = results[0]["full"]["base_model.model.model.embed_tokens.original_module.weight"]
    assert not torch.equal(trained, original)  # the step trained the copy
    for rank, r in enumerate(results):
        merged = r["merged"]
        assert sorted(merged) == sorted(expected), f"rank {rank}"
        for name, tensor in merged.items():
            assert torch.equal(tensor, expected[name]), f"rank {rank}: {name}"
        assert torch.equal(merged["lm_head.weight"], trained) and torch.equal(
            merged["model.embed_tokens.weight"], trained
        )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"target_modules": ["embed_tokens"]}, "LoRA on an embedding"),
        # a LoRA bias on a layer without a bias (Qwen2's down_proj), which PEFT itself cannot merge
        ({"lora_bias": True}, "down_proj has a LoRA bias"),
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
