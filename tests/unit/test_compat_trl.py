"""The TRL compat paths chosen by the installed TRL version: the fused LM head's torch path (TRL before 1.16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from odc_accelerate._compat import trl as trl_compat


def _reference(hidden, weight, bias, targets, temperature, softcap, logit_scale):
    """The LM head's full logits, then log-softmax: what the fused head computes without building the logits."""
    z = F.linear(hidden.double(), weight.double(), bias.double()) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    log_p = torch.log_softmax(z / temperature, dim=-1)
    p = log_p.exp()
    return {
        "log_probs": log_p.gather(-1, targets[:, None])[:, 0],
        "entropy": -(p * log_p).sum(-1),
        "log_sum_sq_probs": torch.log((p * p).sum(-1)),
        "mean_logits": (z / temperature).mean(-1),
        "is_top1": (z.argmax(-1) == targets),
    }


OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_torch_log_probs_match_the_full_logits_values_and_gradients(monkeypatch, softcap):
    monkeypatch.setattr(trl_compat, "_CHUNK_LOGITS", 3 * 50)  # 3 tokens per chunk: 11 tokens take 4 chunks
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    bias = torch.randn(50, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (11,), generator=g)
    targets[3] = int(F.linear(hidden[3], weight, bias).argmax())  # one sure top-1
    args = (hidden, weight, bias, targets, 0.7, 4096, softcap, 1.3, OUTPUTS)

    got = dict(zip(OUTPUTS, trl_compat.torch_log_probs(*args), strict=True))
    want = _reference(hidden, weight, bias, targets, 0.7, softcap, 1.3)
    for key in OUTPUTS:
        assert got[key].shape == (11,), key
        if key == "is_top1":
            assert torch.equal(got[key], want[key]) and bool(got[key][3])
        else:
            torch.testing.assert_close(got[key].double(), want[key], rtol=1e-5, atol=1e-5, msg=key)
    assert not got["mean_logits"].requires_grad and not got["log_sum_sq_probs"].requires_grad

    # Gradients of a loss over log-probs and entropy (the two outputs TRL differentiates) against full autograd.
    weights = torch.rand(11, generator=g)
    (-(got["log_probs"] * weights).sum() + 0.3 * got["entropy"].sum()).backward()
    mine = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    (-(want["log_probs"] * weights).sum() + 0.3 * want["entropy"].sum()).backward()
    for a, b in zip(mine, (hidden.grad, weight.grad, bias.grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_torch_log_probs_without_scored_tokens_stay_connected_to_the_head():
    # A microbatch whose labels are all masked: empty outputs, and a backward that gives zero gradients (TRL's loss
    # reduces them to a differentiable zero).
    hidden = torch.randn(0, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    log_probs, entropy, *_ = trl_compat.torch_log_probs(
        hidden, weight, None, torch.zeros(0, dtype=torch.long), 1.0, 4096, None, 1.0, ("log_probs", "entropy")
    )
    assert log_probs.shape == (0,) and entropy.shape == (0,) and log_probs.requires_grad
    (log_probs.sum() + entropy.sum()).backward()
    assert weight.grad is not None and not weight.grad.any()


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
