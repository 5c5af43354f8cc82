"""What the vLLM sync sends (`odc_accelerate.integrations.vllm.iter_checkpoint_weights`), read through ODC on 2 gloo
ranks after a step: the weights of a checkpoint of the trained model, as ``save_pretrained`` writes them in one
process, with a tied weight also under its second name. vLLM itself is not needed (tests/vllm loads these tensors)."""

from __future__ import annotations

import pytest
import torch

from odc_accelerate.testing import launch
from tests.helpers.workers.vllm_workers import checkpoint_weights_after_a_step


@pytest.mark.parametrize("kind", ["tied", "moe"])
def test_checkpoint_weights_equal_the_trained_models_saved_checkpoint(tmp_path, kind):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from odc_accelerate.testing.models import tiny_causal_lm_config

    results = launch(checkpoint_weights_after_a_step, 2, {"kind": kind}, timeout=300)
    full = {k: torch.from_numpy(v) for k, v in results[0]["full"].items()}
    # The reference: the trained parameters (DTensor's gather) in a one-process model, saved by transformers.
    reference = AutoModelForCausalLM.from_config(tiny_causal_lm_config(kind, hidden_size=32), dtype=torch.float32)
    missing, unexpected = reference.load_state_dict(full, strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if kind == "tied" else []), (missing, unexpected)
    reference.save_pretrained(tmp_path)
    expected = load_file(tmp_path / "model.safetensors")
    if kind == "tied":
        assert "lm_head.weight" not in expected  # a tied checkpoint stores the embedding once
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]  # the sync names the head too
    else:
        # transformers fuses the experts in memory; the checkpoint (and so the sync) keeps them per expert
        assert any(".experts.gate_up_proj" in name for name in full)
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in expected
    for rank, r in enumerate(results):
        weights = {k: torch.from_numpy(v) for k, v in r["weights"].items()}
        assert sorted(weights) == sorted(expected), f"rank {rank}"
        for name, tensor in weights.items():
            assert torch.equal(tensor, expected[name]), f"rank {rank}: {name}"
        assert r["stats"]["parameters"] == len(expected) and r["stats"]["units"] == 3, r["stats"]
