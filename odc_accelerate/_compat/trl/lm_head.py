"""TRL's fused LM head, and a torch path for it on devices without Triton (CPU).

TRL's SFT, DPO and GRPO trainers give their models a fused LM head (``trl.trainer.utils.add_fused_lm_head``): a
forward with ``fused_lm_head=True`` scores the labels through ``trl.trainer.utils._ChunkedLogProbFunction`` without
building the logits. In TRL 1.15 that function always runs a Triton kernel (a CPU tensor fails inside Triton) and is
None where Triton is missing; TRL 1.16 folds the tiles in torch on devices without Triton. Before 1.16 the trainers
built inside `fused_lm_head_torch_path` get a torch path from here: `torch_log_probs`, per-token label scores of an
LM head computed in chunks, without holding the full logits.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from .. import check_signature, installed_version, patched_attribute, require, version_tuple
from . import _LIBRARY

_TRL_WITH_TORCH_LM_HEAD = (1, 16)
_TRITON_DEVICES = ("cuda", "xpu")
_FUSED_LM_HEAD_TRAINERS = {
    "sft": "trl.trainer.sft_trainer",
    "dpo": "trl.trainer.dpo_trainer",
    "grpo": "trl.trainer.grpo_trainer",
    "kto": "trl.trainer.kto_trainer",
}
# What TRL 1.15's fused forward passes to `_ChunkedLogProbFunction.apply`, positionally, in this order.
_LOG_PROB_ARGS = (
    "hidden",
    "weight",
    "bias",
    "targets",
    "temperature",
    "chunk_size",
    "final_logit_softcapping",
    "logit_scale",
    "outputs",
)


def needs_torch_lm_head() -> bool:
    """Whether the installed TRL's fused LM head lacks a path for devices without Triton (TRL before 1.16)."""
    return version_tuple(installed_version(_LIBRARY)) < _TRL_WITH_TORCH_LM_HEAD


@contextlib.contextmanager
def fused_lm_head_torch_path(trainer: str) -> Iterator[None]:
    """Within the block (the ``__init__`` of TRL's SFT, DPO or GRPO trainer), the fused LM head that TRL puts on the
    models also runs on devices without Triton (CPU).

    On TRL 1.16 and later (which has that path itself) the block changes nothing. On TRL 1.15 the forward TRL installs
    on each model (policy and reference) is wrapped: a ``fused_lm_head=True`` call scores the labels with TRL's kernel
    on CUDA / XPU and with `torch_log_probs` elsewhere. The wrapper belongs to the model
    instance; TRL's module is patched for the block only (``add_fused_lm_head``) and for the duration of each fused
    call (``_ChunkedLogProbFunction``).

    Args:
        trainer (`str`): ``"sft"``, ``"dpo"``, ``"grpo"`` or ``"kto"``, the trainer whose ``__init__`` runs in the block.
    """
    if trainer not in _FUSED_LM_HEAD_TRAINERS:
        raise ValueError(f"trainer must be one of {sorted(_FUSED_LM_HEAD_TRAINERS)}, not {trainer!r}")
    if not needs_torch_lm_head():
        yield
        return
    from trl.trainer import utils as trl_utils

    module = importlib.import_module(_FUSED_LM_HEAD_TRAINERS[trainer])
    where = module.__name__
    current = require(module, "add_fused_lm_head", library=_LIBRARY, where=where)
    check_signature(current, ("model",), library=_LIBRARY, where=f"{where}.add_fused_lm_head")
    kernel = require(trl_utils, "_ChunkedLogProbFunction", library=_LIBRARY, where="trl.trainer.utils")
    if kernel is not None:  # None: TRL found no Triton, and every fused call takes the torch path
        check_signature(
            kernel.forward, _LOG_PROB_ARGS, library=_LIBRARY, where="trl.trainer.utils._ChunkedLogProbFunction.forward"
        )

    def wrap(original: Any) -> Any:
        @functools.wraps(original)
        def add_fused_lm_head(model: Any, *args: Any, **kwargs: Any) -> None:
            original(model, *args, **kwargs)
            _route_fused_calls(model, trl_utils)

        return add_fused_lm_head

    with patched_attribute(module, "add_fused_lm_head", wrap, library=_LIBRARY, where=where):
        yield


def _route_fused_calls(model: Any, trl_utils: Any) -> None:
    """Wrap the fused forward TRL just bound to ``model``: fused calls see `_log_prob_function` as TRL's kernel."""
    fused = model.forward  # TRL's `_fused_forward`, bound to the model

    @functools.wraps(getattr(fused, "__func__", fused))  # keeps the model's signature (`generate` validates it)
    def forward(self: Any, *args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if not fused_lm_head:
            return fused(*args, **kwargs)
        with patched_attribute(
            trl_utils,
            "_ChunkedLogProbFunction",
            _log_prob_function,
            library=_LIBRARY,
            where="trl.trainer.utils",
        ):
            return fused(*args, fused_lm_head=True, **kwargs)

    model.forward = types.MethodType(forward, model)


def _log_prob_function(kernel: Any) -> Any:
    class _ChunkedLogProbs:
        """TRL's ``_ChunkedLogProbFunction`` on CUDA / XPU, `torch_log_probs` elsewhere (or without Triton)."""

        @staticmethod
        def apply(*args: Any) -> Any:
            if kernel is not None and args[0].device.type in _TRITON_DEVICES:
                return kernel.apply(*args)
            return torch_log_probs(*args)

    return _ChunkedLogProbs


# ---------------------------------------------------------------------------------------------------- the torch path
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
