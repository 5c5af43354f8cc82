"""Rank function of the PEFT weight-sync test: a tiny Qwen2 with PEFT adapters (plain LoRA, DoRA, a LoRA bias,
``modules_to_save``) trained with ODC on 2 gloo ranks, its merged weights read through `odc_accelerate.integrations.vllm.iter_full_parameters` (what the vLLM sync loads)."""

from __future__ import annotations

from typing import Any

import torch

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "lora_dropout": 0.0}
#: The adapters the vLLM sync merges beyond plain LoRA, as changes to `LORA`: DoRA, a LoRA bias (on Qwen2's q/v
#: projections, which have a bias) and a trained copy of the LM head.
SYNC_CASES = {
    "plain": {},
    "dora": {"use_dora": True},
    "lora_bias": {"lora_bias": True, "target_modules": ["q_proj", "v_proj"]},
    "modules_to_save": {"modules_to_save": ["lm_head"]},
}
#: A tied model whose embedding is trained as one tied copy (PEFT's ``ensure_weight_tying``): the LM head is that copy.
TIED_CASE = {"modules_to_save": ["embed_tokens"], "ensure_weight_tying": True}


def tiny_lora_model(seed: int = 0, change: dict[str, Any] | None = None, kind: str | None = None) -> Any:
    """The tiny offline Qwen2 (or the tiny model of ``kind``, `odc_accelerate.testing.models.tiny_causal_lm_config`;
    float32, random init from ``seed``) with LoRA adapters on three projections (`LORA`, with ``change`` applied)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, set_seed

    from odc_accelerate.demo import tiny_qwen2_config
    from odc_accelerate.testing.models import tiny_causal_lm_config

    set_seed(seed)
    config = tiny_qwen2_config(hidden_size=32) if kind is None else tiny_causal_lm_config(kind, hidden_size=32)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return get_peft_model(model, LoraConfig(**{**LORA, **(change or {})}))


def sharded_sgd_step(rank: int, model: Any, layers: Any) -> Any:
    """Shard ``model`` with FSDP2 (each of ``layers``, then the root) and serve it with an `ODCEngine`; take one SGD
    step at 0.5 through it, rank 0 with two microbatches of random tokens and the others with one. Returns the engine,
    between optimizer steps (its published shards hold the trained weights)."""
    from torch.distributed.fsdp import fully_shard

    from odc_accelerate.engine import ODCEngine
    from odc_accelerate.testing.models import world_mesh

    mesh = world_mesh("cpu")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = ODCEngine(model, timeout=60.0)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2 if rank == 0 else 1):
        ids = torch.randint(0, 1000, (1, 24), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
    engine.pre_optimizer_step()
    optimizer.step()
    optimizer.zero_grad()
    engine.post_optimizer_step()
    return engine


def merged_full_parameters(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """For each of `SYNC_CASES` (plain LoRA, DoRA, a LoRA bias, ``modules_to_save``): shard the PEFT model with FSDP2
    + ODC, take one SGD step (rank 0 two microbatches, rank 1 one; LoRA's B starts at zero, so the step is what makes
    the merge matter), then read the merged weights through ODC (`iter_full_parameters`) and, outside it, every
    parameter with DTensor's own gather (the reference's input); and `TIED_CASE` read as a checkpoint stores it
    (`iter_checkpoint_weights`: the tied copy under both names). One launch for all cases: the rank start-up is most
    of the time."""
    from odc_accelerate.integrations.vllm import VLLMSyncStats, iter_checkpoint_weights, iter_full_parameters

    out = {}
    for case, change in [*SYNC_CASES.items(), ("tied", TIED_CASE)]:
        model = tiny_lora_model(seed=0, change=change, kind="tied" if case == "tied" else None)
        engine = sharded_sgd_step(rank, model, model.base_model.model.model.layers)
        stats = VLLMSyncStats()
        read = iter_checkpoint_weights if case == "tied" else iter_full_parameters
        merged = {name: tensor for name, tensor in read(engine, stats)}
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        engine.close()
        # numpy arrays travel by value (a torch tensor would travel as a shared-memory handle that dies with this rank)
        out[case] = {
            "merged": {k: v.numpy() for k, v in merged.items()},
            "full": {k: v.detach().numpy() for k, v in full.items()},
            "stats": vars(stats),
        }
    return out
