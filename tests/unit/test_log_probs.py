"""`odc_accelerate._compat.trl.lm_head.torch_log_probs`: the LM head's label scores in chunks, against the full logits
in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from odc_accelerate._compat.trl import lm_head as log_probs


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
    monkeypatch.setattr(log_probs, "_CHUNK_LOGITS", 3 * 50)  # 3 tokens per chunk: 11 tokens take 4 chunks
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    bias = torch.randn(50, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (11,), generator=g)
    targets[3] = int(F.linear(hidden[3], weight, bias).argmax())  # one sure top-1
    args = (hidden, weight, bias, targets, 0.7, 4096, softcap, 1.3, OUTPUTS)

    got = dict(zip(OUTPUTS, log_probs.torch_log_probs(*args), strict=True))
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
    scores, entropy, *_ = log_probs.torch_log_probs(
        hidden, weight, None, torch.zeros(0, dtype=torch.long), 1.0, 4096, None, 1.0, ("log_probs", "entropy")
    )
    assert scores.shape == (0,) and entropy.shape == (0,) and scores.requires_grad
    (scores.sum() + entropy.sum()).backward()
    assert weight.grad is not None and not weight.grad.any()
