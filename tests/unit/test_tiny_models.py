"""The tiny Hugging Face models the integration tests train besides the offline default
(`odc_accelerate.testing.models.tiny_causal_lm_config`, `save_tiny_causal_lm`)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("kind", ["untied", "tied", "moe", "hybrid"])
def test_saved_tiny_model_loads_offline_as_built(tmp_path, kind):
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from odc_accelerate.demo import load_offline_tokenizer, offline_vocab_size
    from odc_accelerate.testing.models import save_tiny_causal_lm, tiny_causal_lm_config

    out = save_tiny_causal_lm(kind, tmp_path / kind, seed=3, hidden_size=32)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    set_seed(3)
    built = AutoModelForCausalLM.from_config(tiny_causal_lm_config(kind, hidden_size=32), dtype=torch.float32)
    assert model.config.vocab_size == offline_vocab_size()
    # tied: one weight under both names, in the built and in the loaded model
    for m in (model, built):
        assert (m.get_output_embeddings().weight is m.get_input_embeddings().weight) == (kind == "tied")
    names = {name for name, _ in model.named_parameters()}
    assert names == {name for name, _ in built.named_parameters()}
    if kind == "moe":  # transformers 5 stores the experts fused, one tensor per projection and layer
        assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"} <= names
        assert model.config.num_experts == 4 and model.config.num_experts_per_tok == 2
    if kind == "hybrid":  # 3 Gated DeltaNet layers and 1 full attention, text only
        assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
        assert (
            "model.layers.0.linear_attn.in_proj_qkv.weight" in names
            and "model.layers.3.self_attn.q_proj.weight" in names
        )
    for (name, p), (_, q) in zip(model.named_parameters(), built.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    text = "Tied and mixture-of-experts models."
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == load_offline_tokenizer()(text)["input_ids"]


def test_unknown_kind_is_refused_naming_the_kinds():
    from odc_accelerate.testing.models import tiny_causal_lm_config

    with pytest.raises(ValueError, match="choose one of untied, tied, moe"):
        tiny_causal_lm_config("dense")
