"""Per-token label scores of an LM head computed in chunks, without holding the full logits: a torch version of
TRL's fused LM-head kernel for devices without Triton (CPU).

`odc_accelerate._compat.trl` routes TRL's fused calls here where the installed TRL has no torch path of its own.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

# Logits per token chunk (64 MiB in fp32); each chunk is recomputed in the backward pass.
_CHUNK_LOGITS = 1 << 24


def torch_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    outputs: tuple[str, ...] = ("log_probs",),
) -> tuple[torch.Tensor | None, ...]:
    """Per-token label scores of the LM head ``hidden @ weight.T + bias``, in torch: TRL's fused LM head kernel
    without Triton.

    The logits are ``logit_scale * z``, soft-capped (``c * tanh(./c)``) when ``final_logit_softcapping`` is set, then
    divided by ``temperature``; the projection runs in the autocast dtype (else ``hidden``'s) and everything after it
    in fp32. The tokens go in chunks of at most ``2**24`` logits, each recomputed in the backward pass, so no more
    than one chunk of logits is held at a time.

    Args:
        hidden (`torch.Tensor` of shape `(N, H)`): the hidden states of the scored positions.
        weight (`torch.Tensor` of shape `(V, H)`): the LM head's weight; ``bias`` (`(V,)` or `None`) its bias.
        targets (`torch.Tensor` of shape `(N,)`): the label of each position.
        chunk_size (`int`, *optional*): TRL's vocabulary tile size; unused (a chunk spans the whole vocabulary).
        outputs (`tuple[str, ...]`): which of ``"entropy"``, ``"log_sum_sq_probs"``, ``"mean_logits"`` and
            ``"is_top1"`` to compute besides the log-probabilities.

    Returns:
        ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, each of shape `(N,)` (fp32; ``is_top1``
        bool), `None` for those not in ``outputs``. ``log_probs`` and ``entropy`` are differentiable; ``is_top1`` is
        whether the label is the first maximum of the logits.
    """
    device = hidden.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else hidden.dtype
    step = max(1, _CHUNK_LOGITS // max(1, int(weight.shape[0])))
    options = (dtype, temperature, final_logit_softcapping, logit_scale, tuple(outputs))
    differentiable = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    pieces = []
    for start in range(0, max(1, int(hidden.shape[0])), step):  # one (maybe empty) chunk at least: outputs exist
        chunk = (hidden[start : start + step], weight, bias, targets[start : start + step], *options)
        pieces.append(checkpoint(_score, *chunk, use_reentrant=False) if differentiable else _score(*chunk))
    return tuple(None if parts[0] is None else torch.cat(parts) for parts in zip(*pieces, strict=True))


def _score(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    dtype: torch.dtype,
    temperature: float,
    softcap: float | None,
    logit_scale: float,
    outputs: tuple[str, ...],
) -> tuple[torch.Tensor | None, ...]:
    z = hidden.to(dtype) @ weight.to(dtype).t()
    if bias is not None:
        z = z + bias.to(dtype)
    z = z.float() * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z * (1 / temperature)
    log_z = torch.logsumexp(z, dim=-1)
    log_probs = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z
    entropy = log_z - (torch.softmax(z, dim=-1) * z).sum(-1) if "entropy" in outputs else None
    with torch.no_grad():  # metrics only: TRL's kernel gives them no gradient either
        log_sum_sq_probs = torch.logsumexp(2 * z, dim=-1) - 2 * log_z if "log_sum_sq_probs" in outputs else None
        mean_logits = z.mean(-1) if "mean_logits" in outputs else None
        is_top1 = z.argmax(-1) == targets if "is_top1" in outputs else None
    return log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1
