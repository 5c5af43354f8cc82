"""The engine on tiny Hugging Face models, against one process (run through :func:`odc_accelerate.testing.launch`).

A dense Llama with grouped-query attention (untied) and a Qwen3-MoE, fp32, built from configs. ``plan[step][rank]``
lists the lengths of a rank's microbatches (one sequence each, counts differing per rank), trained with AdamW.

Two one-process references (`reference`): ``"split"`` runs each microbatch on its own, as the ranks do, and adds the
gradients as the ``ordered`` reduction does (each rank's in order, then the ranks' sums in rank order);
``"concatenated"`` runs each step's microbatches as one batch. The two differ by fp32 rounding only, which AdamW
amplifies in near-zero gradient entries (docs/versions.md), so the engine's own error is measured against ``"split"``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from odc_accelerate.engine import ODCEngine
from odc_accelerate.loss import loss_scale
from odc_accelerate.testing.models import make_steps

VOCAB = 128


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    """The tiny model ``kind`` ("llama" or "moe"), fp32, built with ``seed``."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: k/v heads repeated for the queries
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8, tie_word_embeddings=True, **common
    )
    return Qwen3MoeForCausalLM(cfg)


def _nll(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids[:, :-1]).logits.float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="sum")


def _full(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {
        n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().numpy().copy()
        for n, t in tensors.items()
    }


def hf_parity_runs(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train each of ``spec["cases"]`` (``{"model": kind, "reduction": name}``) in turn with `ODCEngine`, one
    ``fully_shard`` per decoder layer and one on the root. Returns, per ``"kind/reduction"``, the full parameters after
    the last step and the full gradients each step handed to the optimizer."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    for case in spec["cases"]:
        model = build(case["model"])
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        engine = ODCEngine(model, timeout=60.0, reduction=case["reduction"])
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        grads = []
        for step in make_steps(spec["plan"], VOCAB, seed=1):
            scale = loss_scale(sum(ids.shape[1] - 1 for mbs in step for ids in mbs), world_size)
            for ids in step[rank]:
                (_nll(model, ids) * scale).backward()
            engine.pre_optimizer_step()
            grads.append(_full({n: p.grad for n, p in model.named_parameters()}))
            optim.step()
            optim.zero_grad()
            engine.post_optimizer_step()
        out[f"{case['model']}/{case['reduction']}"] = {"params": _full(dict(model.named_parameters())), "grads": grads}
        engine.close()
    dist.barrier()
    return out


def reference(kind: str, plan: list, how: str, world_size: int = 2) -> dict[str, Any]:
    """One process training ``kind`` on ``plan``'s steps, ``how`` = ``"split"`` or ``"concatenated"`` (module
    docstring), with the ranks' loss scale. Returns the parameters after the last step and each step's gradients.

    Runs on one torch thread, as each rank does (`odc_accelerate.testing.launch`): CPU kernels split their reductions
    by thread (the embedding's backward among them), so another thread count adds in another order and the bitwise
    comparison with the ``ordered`` reduction would fail."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(kind, plan, how, world_size)
    finally:
        torch.set_num_threads(threads)


def _reference(kind: str, plan: list, how: str, world_size: int) -> dict[str, Any]:
    model = build(kind)
    params = dict(model.named_parameters())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    grads = []
    for step in make_steps(plan, VOCAB, seed=1):
        scale = loss_scale(sum(ids.shape[1] - 1 for mbs in step for ids in mbs), world_size)
        if how == "concatenated":
            (_nll(model, torch.cat([ids for mbs in step for ids in mbs])) * scale).backward()
            total = {n: p.grad for n, p in params.items()}
        else:
            total = {n: torch.zeros_like(p) for n, p in params.items()}
            for mbs in step:
                local = {n: torch.zeros_like(p) for n, p in params.items()}
                for ids in mbs:
                    (_nll(model, ids) * scale).backward()
                    for n, p in params.items():
                        local[n] += p.grad
                    model.zero_grad()
                for n in params:
                    total[n] += local[n]
        for n, p in params.items():  # the world-size divide of the reduce-scatter
            p.grad = total[n] / world_size
        grads.append(_full({n: p.grad for n, p in params.items()}))
        optim.step()
        optim.zero_grad()
    return {"params": _full(params), "grads": grads}
