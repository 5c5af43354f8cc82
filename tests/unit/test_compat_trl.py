"""The TRL compat paths chosen by the installed TRL version: the fused LM head's torch path (TRL before 1.16)."""

from __future__ import annotations

import pytest
import torch

from odc_accelerate._compat import trl as trl_compat


class _CudaOnlyKernel:
    """Stands in for TRL 1.15's ``_ChunkedLogProbFunction``: its Triton kernel fails on CPU tensors."""

    calls = 0

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs
    ):
        raise NotImplementedError

    @classmethod
    def apply(cls, *args):
        cls.calls += 1
        raise RuntimeError("0 active drivers ([]). There should only be one.")


def _tiny_model():
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    sizes = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    config = Qwen2Config(vocab_size=96, **sizes)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    ("trainer", "module_name"), [("sft", "sft_trainer"), ("dpo", "dpo_trainer"), ("grpo", "grpo_trainer")]
)
@pytest.mark.parametrize("version", ["1.15.0", "1.16.0"])
def test_fused_lm_head_path_is_chosen_by_the_trl_version(monkeypatch, trainer, module_name, version):
    import importlib

    import trl
    from trl.trainer import utils as trl_utils

    module = importlib.import_module(f"trl.trainer.{module_name}")
    monkeypatch.setattr(trl, "__version__", version)
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", _CudaOnlyKernel)
    _CudaOnlyKernel.calls = 0
    add_fused_lm_head = module.add_fused_lm_head
    torch_path = version == "1.15.0"
    assert trl_compat.needs_torch_lm_head() is torch_path

    model = _tiny_model()
    with trl_compat.fused_lm_head_torch_path(trainer):
        assert (module.add_fused_lm_head is not add_fused_lm_head) is torch_path  # TRL 1.16: nothing patched
        module.add_fused_lm_head(
            model, outputs=("log_probs", "entropy", "is_top1")
        )  # what the trainer's __init__ does
    assert module.add_fused_lm_head is add_fused_lm_head

    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :4] = -100
    if not torch_path:  # the installed TRL's own path runs: the stand-in kernel fails, as TRL 1.15's does on CPU
        with pytest.raises(RuntimeError, match="active drivers"):
            model(input_ids=ids, labels=labels, fused_lm_head=True)
        return
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert _CudaOnlyKernel.calls == 0 and trl_utils._ChunkedLogProbFunction is _CudaOnlyKernel  # restored after
    with torch.no_grad():
        log_p = torch.log_softmax(model(input_ids=ids).logits.double()[:, :-1], dim=-1)
    shifted = labels[:, 1:]
    mask = shifted != -100
    want = log_p.gather(-1, shifted.clamp(min=0)[..., None])[..., 0] * mask
    torch.testing.assert_close(out.log_probs.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.label_mask, mask)
    out.loss.backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    assert model(input_ids=ids).logits.shape == (2, 9, 96)  # an unfused call is the model's own forward


def test_fused_lm_head_path_names_the_trainers():
    with pytest.raises(ValueError, match="'dpo', 'grpo', 'sft'"):
        with trl_compat.fused_lm_head_torch_path("ppo"):
            pass
