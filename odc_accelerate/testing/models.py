"""A small transformer-like language model for tests and benchmarks, plus FSDP2 wrapping and data."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ToyConfig:
    vocab: int = 128
    dim: int = 32
    heads: int = 4
    layers: int = 3
    mlp_ratio: int = 4
    # Each block also has a `gate` (registered between the attention and the MLP) that only sequences of odd length
    # go through: a backward of an even-length sequence gives its params no gradient.
    gated: bool = False


class Block(nn.Module):
    """Pre-norm block: causal self-attention (SDPA) and an MLP, each residual."""

    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.dim)
        # No qkv bias (as in Llama): the key bias gets a mathematically zero gradient, whose rounding noise
        # AdamW would amplify into spurious parameter differences between equivalent runs.
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.gate = nn.Linear(cfg.dim, cfg.dim) if cfg.gated else None
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        if self.gate is not None and t % 2 == 1:
            x = x + self.gate(x)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ToyLM(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(cfg: ToyConfig, seed: int = 0) -> ToyLM:
    torch.manual_seed(seed)
    return ToyLM(cfg)


def world_mesh(device_type: str):
    """One 1-D DeviceMesh on the default (world) process group.

    ``fully_shard`` without ``mesh=`` builds its own default mesh per call; under a gloo default group on a CUDA
    machine each of those gets a new process group. One mesh passed to every call keeps one group, as a real job has.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dist.group.WORLD, device_type)


def shard_model(
    model: ToyLM,
    *,
    mp_policy=None,
    reshard_after_forward: bool | int = True,
    shard_placement_fn: Callable | None = None,
    mesh=None,
    block_mesh=None,
) -> ToyLM:
    """FSDP2-wrap like accelerate does: each block, then the root (embedding, final norm, head).

    ``mesh`` defaults to :func:`world_mesh` on the model's device type; ``block_mesh`` (default ``mesh``) is the
    blocks' own, e.g. a second mesh over the same ranks.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh is None:
        mesh = world_mesh(next(model.parameters()).device.type)
    kwargs = dict(
        mp_policy=mp_policy or MixedPrecisionPolicy(),
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
    )
    for block in model.blocks:
        fully_shard(block, mesh=block_mesh if block_mesh is not None else mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def token_loss_sum(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross entropy of ``ids`` [B, T] and the number of label tokens."""
    logits = model(ids[:, :-1])
    labels = ids[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), reduction="sum")
    return loss, labels.numel()


def make_steps(plan: list[list[list[int]]], vocab: int, seed: int) -> list[list[list[torch.Tensor]]]:
    """Token batches for ``plan[step][rank] = [seq_len, ...]`` (one sequence per microbatch)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        [[torch.randint(0, vocab, (1, length + 1), generator=gen) for length in rank_plan] for rank_plan in step]
        for step in plan
    ]
