"""Per-rank bodies of the HSDP engine tests: 4 processes as 2 emulated hosts x 2 ranks (``ODC_HOST_ID``)."""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from odc_accelerate.engine import ODCEngine
from odc_accelerate.loss import loss_scale
from odc_accelerate.testing.models import ToyConfig, build_model, make_steps, shard_model, token_loss_sum
from tests.helpers.infra.dist_counter import count_dist_calls

from .engine_workers import full_params, run_claimed


def _hsdp_model(cfg: ToyConfig, replicas: int, shards: int, seed: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("dp_replicate", "dp_shard"))
    return shard_model(build_model(cfg, seed=seed), mesh=mesh)


def _steps(model, engine, optim, steps, rank, world_size, kill_at=None) -> list[dict[str, Any]]:
    """Train ``steps``; per step the torch.distributed calls made by the microbatches and by pre_optimizer_step."""
    counts = []
    for index, step in enumerate(steps):
        if kill_at == (rank, index):
            os.kill(os.getpid(), signal.SIGKILL)
        n_global = sum(ids.shape[1] - 1 for rank_mbs in step for ids in rank_mbs)
        scale = loss_scale(n_global, world_size)  # global tokens over all replicas and shards
        with count_dist_calls() as in_microbatches:
            for ids in step[rank]:
                loss, _ = token_loss_sum(model, ids)
                (loss * scale).backward()
        with count_dist_calls() as at_boundary:
            engine.pre_optimizer_step()
        optim.step()
        optim.zero_grad()
        engine.post_optimizer_step()
        counts.append({"microbatches": dict(in_microbatches), "pre_optimizer_step": dict(at_boundary)})
    return counts


def train_hsdp(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """The HSDP engine end to end, in one launch.

    1. A shard group spread over two emulated hosts is refused (every rank reports the error).
    2. With one host per shard group, train ``spec["plan"]`` (any microbatch count per rank, including none),
       saving a distributed checkpoint after step ``spec["save_after"]``.
    3. Build a fresh model and engine, load the checkpoint and train the remaining steps again.
    """
    replicas, shards = spec["mesh"]
    cfg = ToyConfig(**spec.get("cfg", {}))
    out: dict[str, Any] = {}

    os.environ["ODC_HOST_ID"] = f"host{rank % replicas}"  # shard group [0, 1] on two hosts
    model = _hsdp_model(cfg, replicas, shards, seed=0)
    try:
        ODCEngine(model, timeout=60.0)
        out["refusal"] = None
    except ValueError as err:
        out["refusal"] = str(err)
    del model

    os.environ["ODC_HOST_ID"] = f"host{rank // shards}"  # one host per shard group, as on real nodes
    steps = make_steps(spec["plan"], cfg.vocab, seed=spec.get("data_seed", 1))
    save_after = spec["save_after"]
    model = _hsdp_model(cfg, replicas, shards, seed=0)
    engine = ODCEngine(model, timeout=60.0, replicate_bucket_bytes=spec["bucket_bytes"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out["transport"] = engine.transport.name
    out["replicas"], out["shard_world"] = engine.replicas, engine.world_size
    out["buckets"] = engine.replicate_buckets
    out["counts"] = _steps(model, engine, optim, steps[: save_after + 1], rank, world_size)
    out["replicate_bytes"] = engine.last_step_stats.replicate_bytes

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=spec["checkpoint"])
    out["params_saved"] = full_params(model)
    out["counts"] += _steps(model, engine, optim, steps[save_after + 1 :], rank, world_size)
    out["params"] = full_params(model)
    engine.close()

    model = _hsdp_model(cfg, replicas, shards, seed=123)  # other initial weights: the checkpoint must replace them
    engine = ODCEngine(model, timeout=60.0, replicate_bucket_bytes=spec["bucket_bytes"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=spec["checkpoint"])
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    engine.republish()
    out["params_loaded"] = full_params(model)
    _steps(model, engine, optim, steps[save_after + 1 :], rank, world_size)
    out["params_resumed"] = full_params(model)
    engine.close()
    dist.barrier()
    return out


def train_hsdp_dynamic(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """The dynamic plan on the HSDP mesh, once per memory policy of ``spec["policies"]`` (a fresh model each): every
    rank of both replicas claims from one queue per step (each step's sequences, one per microbatch); rank
    ``spec["slow_rank"]`` runs at most one microbatch per step, waiting after it until a peer has drained the queue
    (files in ``spec["drain_dir"]``, see `run_claimed`)."""
    replicas, shards = spec["mesh"]
    os.environ["ODC_HOST_ID"] = f"host{rank // shards}"
    cfg = ToyConfig(**spec.get("cfg", {}))
    out: dict[str, Any] = {}
    for policy in spec["policies"]:
        model = _hsdp_model(cfg, replicas, shards, seed=0)
        engine = ODCEngine(model, timeout=60.0, memory_policy=policy)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        claimed, calls, kept = [], [], []
        for step_index, step in enumerate(make_steps(spec["plan"], cfg.vocab, seed=1)):
            queue = [ids for rank_mbs in step for ids in rank_mbs]
            scale = loss_scale(sum(ids.shape[1] - 1 for ids in queue), world_size)
            kept.append(engine.memory_choices())
            with count_dist_calls() as in_microbatches:
                drained = os.path.join(spec["drain_dir"], f"{policy}-step{step_index}")
                claimed.append(run_claimed(engine, model, queue, scale, drained, rank == spec["slow_rank"]))
            calls.append(dict(in_microbatches))
            engine.pre_optimizer_step()
            optim.step()
            optim.zero_grad()
            engine.post_optimizer_step()
        out[policy] = {
            "claimed": claimed,
            "calls": calls,
            "kept": kept,
            "scatters": engine.last_step_stats.scatters,
            "params": full_params(model),
        }
        engine.close()
        dist.barrier()
    return out


def train_hsdp_kill(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train on the HSDP mesh; ``spec["kill_at"] = (rank, step)`` is SIGKILLed at the start of that step."""
    replicas, shards = spec["mesh"]
    with open(os.path.join(spec["pid_dir"], f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    os.environ["ODC_HOST_ID"] = f"host{rank // shards}"
    cfg = ToyConfig(**spec.get("cfg", {}))
    model = _hsdp_model(cfg, replicas, shards, seed=0)
    engine = ODCEngine(model, timeout=spec.get("timeout", 120.0))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps = make_steps(spec["plan"], cfg.vocab, seed=1)
    _steps(model, engine, optim, steps, rank, world_size, kill_at=tuple(spec["kill_at"]))
    engine.close()
    return {"params": {k: np.asarray(v) for k, v in full_params(model).items()}}
