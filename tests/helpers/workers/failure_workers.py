"""Per-rank functions for the engine's bad-input, cleanup and transport stress tests."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from odc_accelerate.engine import ODCEngine
from odc_accelerate.testing.models import ToyConfig, build_model, shard_model, world_mesh
from odc_accelerate.transport import BufferSpec, ShmTransport


def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as err:  # the tests compare type and message
        return type(err).__name__, str(err)
    return "no error", ""


def _job_files(job_id: str) -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"odc_{job_id}_"))


def _write_pid(pid_dir: str | None, rank: int) -> None:
    if pid_dir:
        with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))


def _unlinked_handles(transport: ShmTransport) -> dict[str, Any]:
    """What this process holds of the transport's files: its mappings and lock descriptors, as the kernel lists them.

    A file whose name is gone shows as ``<path> (deleted)``. Segment modes come from ``/proc/self/map_files``, which
    only a privileged process may stat (None otherwise); lock-file modes from the open descriptors.
    """
    stem = f"/dev/shm/odc_{transport.job_id}_"
    maps, seg_modes = [], []
    with open("/proc/self/maps") as f:
        for line in f:
            if stem in line:
                maps.append(line.split(None, 5)[5].strip())
                try:
                    st = os.stat(f"/proc/self/map_files/{line.split()[0]}")
                    seg_modes.append(oct(st.st_mode & 0o777))
                except PermissionError:
                    seg_modes.append(None)
    return {
        "segment_maps": sorted(maps),
        "segment_modes": seg_modes,
        "lock_fds": [os.readlink(f"/proc/self/fd/{fd}") for fd in transport._lock_fds],
        "lock_modes": [oct(os.fstat(fd).st_mode & 0o777) for fd in transport._lock_fds],
    }


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
        elif case == "hsdp_shard_across_hosts":  # each rank its own (emulated) host: the shard group spans hosts
            mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
            model = shard_model(build_model(cfg), mesh=mesh)
            os.environ["ODC_HOST_ID"] = f"host{rank}"
            try:
                out[case] = _outcome(lambda m=model: ODCEngine(m))
            finally:
                del os.environ["ODC_HOST_ID"]
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
            mesh = world_mesh("cpu")
            for block in model.blocks:
                fully_shard(block, offload_policy=policy, mesh=mesh)
            fully_shard(model, offload_policy=policy, mesh=mesh)
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
        elif case == "grad_dtype_none":  # a gradient of any dtype, no reduce_dtype: no fixed accumulator dtype
            model = build_model(cfg)
            model.blocks[1].up.weight.grad_dtype = None
            model = shard_model(model)
            out[case] = _outcome(lambda m=model: ODCEngine(m))
        elif case == "lifecycle":
            model = shard_model(build_model(cfg))
            with ODCEngine(model, timeout=30) as engine:
                first = _outcome(engine.post_optimizer_step)
                engine.pre_optimizer_step()
                second = _outcome(engine.pre_optimizer_step)
                engine.post_optimizer_step()
            out[case] = (first[0] + " / " + second[0], first[1] + " / " + second[1])
        elif case in ("optimizer_grouping_differs", "optimizer_order_differs", "optimizer_on_rank0_only"):
            out[case] = _optimizer_groups_case(case, rank, cfg)
        else:
            raise ValueError(case)
        dist.barrier()
    return out


def _optimizer_groups_case(case: str, rank: int, cfg: ToyConfig) -> tuple[str, str]:
    """One step with the same optimizer groups on every rank (it must pass), then a step whose optimizer is built
    differently on rank 1: its params grouped otherwise, or one group's order reversed; or rank 1 passes none."""
    from odc_accelerate.testing.models import token_loss_sum

    model = shard_model(build_model(cfg))
    params = [p for _, p in model.named_parameters()]
    ids = torch.randint(0, cfg.vocab, (1, 9), generator=torch.Generator().manual_seed(rank))

    def step(optimizer: torch.optim.Optimizer | None) -> None:
        token_loss_sum(model, ids)[0].backward()
        engine.pre_optimizer_step(optimizer)
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        engine.post_optimizer_step()

    with ODCEngine(model, timeout=30) as engine:
        step(torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1}], lr=0.1))
        if case == "optimizer_on_rank0_only":
            return _outcome(lambda: step(torch.optim.SGD(params, lr=0.1) if rank == 0 else None))
        if rank == 0:
            groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1}]
        elif case == "optimizer_grouping_differs":
            groups = [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.1}]
        else:
            groups = [{"params": params[:2]}, {"params": params[:1:-1], "weight_decay": 0.1}]
        return _outcome(lambda: step(torch.optim.SGD(groups, lr=0.1)))


def _two_group_model(cfg: ToyConfig, world_size: int) -> torch.nn.Module:
    """One fully_shard call whose params land on two process groups (per-param mesh) -> 2 param groups."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from odc_accelerate._compat.torch.fsdp import per_param_placer

    model = build_model(cfg)
    on_other = per_param_placer(DeviceMesh.from_group(dist.new_group(list(range(world_size))), "cpu"))

    def place(param):
        return on_other(Shard(0)) if param.ndim == 1 else None

    fully_shard(model, shard_placement_fn=place)
    return model


def context_exit_cleans_up(rank: int, world_size: int) -> dict[str, Any]:
    """An exception inside ``with ODCEngine(...)``: this rank's file names inside the block and after it (none: they
    are unlinked at the end of set-up), then a plain FSDP2 step (the engine restored FSDP2's collectives)."""
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
    from odc_accelerate.testing.models import token_loss_sum

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
            **_unlinked_handles(transport),
            "paths": list(transport._paths),
        }
    finally:
        transport.close()


def names_gone_after_setup(rank: int, world_size: int, pid_dir: str, adds: int) -> dict[str, Any]:
    """Right after ``register``: which names of the job are left, what this rank still maps, and whether reads,
    locked adds and barriers still work on the unlinked files.

    Every rank publishes ``10 * rank + arange(8)`` and adds ``rank + 1`` into every owner's accumulator ``adds``
    times, so each accumulator ends at ``adds * world_size * (world_size + 1) / 2``.
    """
    _write_pid(pid_dir, rank)
    transport = ShmTransport(rank, world_size, timeout=120)
    try:
        mine = transport.register(
            {"pub": BufferSpec(numel=8, dtype=torch.float32), "acc": BufferSpec(numel=1000, dtype=torch.float64)}
        )
        names_after_register = _job_files(transport.job_id)
        handles = _unlinked_handles(transport)
        mine["pub"].copy_(torch.arange(8, dtype=torch.float32) + 10 * rank)
        transport.barrier()
        reads = []
        for peer in range(world_size):
            out = torch.empty(8, dtype=torch.float32)
            transport.read(peer, "pub", out)
            reads.append(out.tolist())
        payload = torch.full((1000,), float(rank + 1), dtype=torch.float64)
        for i in range(adds):
            for owner in range(world_size):
                transport.accumulate((owner + rank + i) % world_size, "acc", payload)
        transport.barrier()
        return {
            "job_id": transport.job_id,
            "names_after_register": names_after_register,
            **handles,
            "reads": reads,
            "acc": sorted(set(mine["acc"].tolist())),
            "names_at_end": _job_files(transport.job_id),
        }
    finally:
        transport.close()


def train_until_stopped(rank: int, world_size: int, spec: dict[str, Any]) -> int:
    """Train the toy LM with ODC, one sequence per rank and step, until killed or ``spec["seconds"]`` pass.

    Writes ``rank<r>.pid`` and, after each step, ``rank<r>.steps`` (the number of finished steps) under
    ``spec["pid_dir"]`` so that a test can signal the ranks mid-run. ``spec["raise_at"] = (rank, step)`` makes that
    rank raise before that step's barrier. Returns the number of steps run.
    """
    from odc_accelerate.loss import loss_scale
    from odc_accelerate.testing.models import token_loss_sum

    pid_dir = spec["pid_dir"]
    _write_pid(pid_dir, rank)
    cfg = ToyConfig(layers=2)
    model = shard_model(build_model(cfg))
    engine = ODCEngine(model, timeout=spec.get("timeout", 120.0))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    deadline = time.monotonic() + spec["seconds"]
    steps = 0
    while time.monotonic() < deadline:
        ids = torch.randint(0, cfg.vocab, (1, 17), generator=gen)
        loss, _ = token_loss_sum(model, ids)
        (loss * loss_scale(16 * world_size, world_size)).backward()
        if spec.get("raise_at") == (rank, steps):
            raise RuntimeError(f"rank {rank} fails on purpose at step {steps}")
        engine.pre_optimizer_step()
        optim.step()
        optim.zero_grad()
        engine.post_optimizer_step()
        steps += 1
        marker = os.path.join(pid_dir, f"rank{rank}.steps")
        with open(marker + ".tmp", "w") as f:
            f.write(str(steps))
        os.replace(marker + ".tmp", marker)
    engine.close()
    return steps
