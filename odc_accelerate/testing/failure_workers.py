"""Per-rank functions for the engine's bad-input, cleanup and transport stress tests."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from ..engine import ODCEngine
from ..transport import BufferSpec, ShmTransport
from .models import ToyConfig, build_model, shard_model


def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as err:  # the tests compare type and message
        return type(err).__name__, str(err)
    return "no error", ""


def _job_files(job_id: str) -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"odc_{job_id}_"))


def bad_inputs(rank: int, world_size: int, cases: list[str]) -> dict[str, tuple[str, str]]:
    """Try ODCEngine on each unsupported set-up; return (exception type, message) per case."""
    from torch.distributed.device_mesh import init_device_mesh

    cfg = ToyConfig(layers=2)
    out: dict[str, tuple[str, str]] = {}
    for case in cases:
        if case == "plain_module":
            out[case] = _outcome(lambda: ODCEngine(build_model(cfg)))
        elif case == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel

            model = FullyShardedDataParallel(build_model(cfg), device_id=torch.device("cpu"))
            out[case] = _outcome(lambda m=model: ODCEngine(m))
        elif case == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(build_model(cfg))
            out[case] = _outcome(lambda m=model: ODCEngine(m))
        elif case == "hsdp":
            mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
            model = shard_model(build_model(cfg), mesh=mesh)
            out[case] = _outcome(lambda m=model: ODCEngine(m))
        elif case == "hpz":  # needs world_size 4: reshard to groups of 2 after forward
            model = shard_model(build_model(cfg), reshard_after_forward=2)
            out[case] = _outcome(lambda m=model: ODCEngine(m))
        elif case == "several_param_groups":
            model = _two_group_model(cfg, world_size)
            out[case] = _outcome(lambda m=model: ODCEngine(m))
        elif case == "different_models":
            model = shard_model(build_model(ToyConfig(layers=2 + rank)))
            out[case] = _outcome(lambda m=model: ODCEngine(m))
        elif case == "offload_on_rank1_only":  # refused on one rank: every rank must raise, none may hang
            from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

            model = build_model(cfg)
            policy = CPUOffloadPolicy(pin_memory=False) if rank == 1 else OffloadPolicy()
            for block in model.blocks:
                fully_shard(block, offload_policy=policy)
            fully_shard(model, offload_policy=policy)
            out[case] = _outcome(lambda m=model: ODCEngine(m))
        elif case == "unknown_transport":
            model = shard_model(build_model(cfg))
            out[case] = _outcome(lambda m=model: ODCEngine(m, transport="carrier-pigeon"))
        elif case == "bad_timeout":
            model = shard_model(build_model(cfg))
            out[case] = _outcome(lambda m=model: ODCEngine(m, timeout=0))
        elif case == "nested_module":
            model = shard_model(build_model(cfg))
            out[case] = _outcome(lambda m=model: ODCEngine(m.blocks[0]))
        elif case == "lifecycle":
            model = shard_model(build_model(cfg))
            with ODCEngine(model, timeout=30) as engine:
                first = _outcome(engine.post_optimizer_step)
                engine.pre_optimizer_step()
                second = _outcome(engine.pre_optimizer_step)
                engine.post_optimizer_step()
            out[case] = (first[0] + " / " + second[0], first[1] + " / " + second[1])
        else:
            raise ValueError(case)
        dist.barrier()
    return out


def _two_group_model(cfg: ToyConfig, world_size: int) -> torch.nn.Module:
    """One fully_shard call whose params land on two process groups (per-param mesh) -> 2 param groups."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    model = build_model(cfg)
    other = DeviceMesh.from_group(dist.new_group(list(range(world_size))), "cpu")
    other_info = FSDPMeshInfo(other, shard_mesh_dim=0)

    def place(param):
        return ShardPlacementResult(Shard(0), other_info) if param.ndim == 1 else None

    fully_shard(model, shard_placement_fn=place)
    return model


def context_exit_cleans_up(rank: int, world_size: int) -> dict[str, Any]:
    """An exception inside ``with ODCEngine(...)`` removes this rank's files before it propagates."""
    model = shard_model(build_model(ToyConfig(layers=2)))
    job = None
    try:
        with ODCEngine(model, timeout=30) as engine:
            job = engine.transport.job_id
            during = [f for f in _job_files(job) if f"_r{rank}_" in f]
            raise KeyError("boom")
    except KeyError:
        pass
    after = [f for f in _job_files(job) if f"_r{rank}_" in f]
    # FSDP2's own collectives are back after close: a plain step must work.
    from .models import token_loss_sum

    loss, _ = token_loss_sum(model, torch.randint(0, 128, (1, 9)))
    loss.backward()
    return {"during": during, "after": after}


def stress_accumulate(rank: int, world_size: int, adds: int, numel: int) -> dict[str, Any]:
    """Every rank adds integer-valued floats into every owner's buffer ``adds`` times, concurrently."""
    transport = ShmTransport(rank, world_size, timeout=120)
    try:
        mine = transport.register(
            {"acc": BufferSpec(numel=numel, dtype=torch.float32), "pub": BufferSpec(numel=4, dtype=torch.int64)}
        )
        mine["pub"].fill_(rank + 1)
        transport.barrier()
        peer_pub = [torch.zeros(4, dtype=torch.int64) for _ in range(world_size)]
        for peer in range(world_size):
            transport.read(peer, "pub", peer_pub[peer])
        payload = torch.arange(numel, dtype=torch.float32) % 13 + rank + 1
        for i in range(adds):
            owner = (rank + i) % world_size
            transport.accumulate(owner, "acc", payload)
        transport.barrier()
        return {
            "acc": mine["acc"].clone().numpy(),
            "peer_pub": [int(t[0]) for t in peer_pub],
            "modes": [oct(os.stat(p).st_mode & 0o777) for p in transport._paths],
            "paths": list(transport._paths),
        }
    finally:
        transport.close()
