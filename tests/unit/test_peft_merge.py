"""The vLLM sync's PEFT merge (`odc_accelerate.integrations.peft`) in one process: fed a PEFT model's parameters as
the sync reads them (each tensor once, under its first name), it gives what PEFT's own ``merge_and_unload`` gives, bit
for bit, for plain LoRA, DoRA, a LoRA bias and ``modules_to_save``; what it does not merge is refused by name. The
sharded path (2 ranks, ODC's reads) is tests/multiprocess/test_vllm_sync_peft.py."""

from __future__ import annotations

import copy

import pytest
import torch

from odc_accelerate.integrations.peft import PEFT_PREFIX, sync_merge
from odc_accelerate.integrations.vllm import check_vllm_sync_model
from tests.helpers.workers.peft_workers import LORA, SYNC_CASES


def _peft_model(kind: str, change: dict, dtype: torch.dtype = torch.float32):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, set_seed

    from odc_accelerate.testing.models import tiny_causal_lm_config

    set_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_causal_lm_config(kind, hidden_size=32), dtype=dtype)
    model = get_peft_model(model, LoraConfig(**{**LORA, **change}))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # as after training: every adapter, magnitude, bias and trained copy off its initial value
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=gen).to(p.dtype))
    return model


def _merged(model) -> tuple[dict[str, torch.Tensor], dict[str, str | None]]:
    merge = sync_merge(model)
    out = {}
    for name, p in model.named_parameters():  # each tensor once, under its first name: as the sync reads them
        for served, tensor in merge.feed(name, p.detach().clone()):
            out[served.removeprefix(PEFT_PREFIX)] = tensor
    merge.finish()
    tied = {n: merge.served_name(n) for n, _ in model.named_parameters(remove_duplicate=False)}
    return out, tied


@pytest.mark.parametrize(
    "kind, change, dtype",
    [
        *[("untied", change, torch.float32) for change in SYNC_CASES.values()],
        ("untied", SYNC_CASES["dora"], torch.bfloat16),  # PEFT's fp32 product of half-precision B @ A on CPU
        ("tied", {"modules_to_save": ["embed_tokens"], "ensure_weight_tying": True}, torch.float32),
    ],
    ids=[*SYNC_CASES, "dora-bf16", "tied-modules_to_save"],
)
def test_the_merge_equals_peft_merge_and_unload(kind, change, dtype):
    model = _peft_model(kind, change, dtype)
    merged, served = _merged(model)
    unloaded = copy.deepcopy(model).merge_and_unload()
    expected = dict(unloaded.named_parameters())  # tied weights once, as vLLM's tied model holds them
    assert sorted(merged) == sorted(expected)
    for name, tensor in merged.items():
        assert tensor.dtype == expected[name].dtype
        assert torch.equal(tensor, expected[name]), name
    # the adapters changed the served weights (the case is not vacuous)
    base = {n.removeprefix(PEFT_PREFIX).replace(".base_layer", ""): p for n, p in model.named_parameters()}
    changed = [n for n, t in merged.items() if n in base and not torch.equal(t, base[n])]
    assert changed, "no served weight differs from the base model's"
    if kind == "tied":
        # the LM head is the embedding's trained copy under its other name (what iter_checkpoint_weights sends)
        assert served[PEFT_PREFIX + "lm_head.modules_to_save.default.weight"] == PEFT_PREFIX + "lm_head.weight"
        assert served[PEFT_PREFIX + "lm_head.original_module.weight"] is None
        assert unloaded.lm_head.weight is unloaded.model.embed_tokens.weight


@pytest.mark.parametrize(
    "kind, change, message",
    [
        # a tied embedding and LM head, one of them trained as a copy: the served model, which ties them, loses it
        ("tied", {"modules_to_save": ["lm_head"]}, "ensure_weight_tying=True"),
        ("tied", {"modules_to_save": ["embed_tokens"]}, "ensure_weight_tying=True"),
        ("tied", {"target_modules": ["q_proj", "lm_head"]}, "ensure_weight_tying=True"),
        # a LoRA bias on a layer with no bias (Qwen2's down_proj): PEFT itself cannot merge it
        ("untied", {"lora_bias": True}, "down_proj has a LoRA bias"),
        ("untied", {"trainable_token_indices": [1, 2]}, r"trainable tokens \(trainable_token_indices\)"),
    ],
)
def test_what_the_merge_would_serve_wrong_is_refused_by_name(kind, change, message):
    model = _peft_model(kind, change)
    with pytest.raises(NotImplementedError, match=message) as err:
        check_vllm_sync_model(model)
    assert str(err.value).startswith(PEFT_PREFIX)


def test_replicated_layers_are_refused():
    model = _peft_model("untied", {"layer_replication": [[0, 2], [1, 2]]})
    with pytest.raises(NotImplementedError, match="layer_replication"):
        check_vllm_sync_model(model)
