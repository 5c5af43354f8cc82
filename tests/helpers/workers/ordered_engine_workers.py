"""Per-rank bodies of the engine's ordered-reduction tests (``ODCEngine(reduction="ordered")``).

One launch trains the toy LM once per configuration (transport, memory policy, a rank slowed at random microbatches or
not), a fresh model each time, so that every configuration's weights can be compared bit for bit with the others and
with one process.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import torch
import torch.distributed as dist

from odc_accelerate.engine import ODCEngine
from odc_accelerate.loss import loss_scale
from odc_accelerate.testing.models import ToyConfig, build_model, make_steps, shard_model, token_loss_sum

from .engine_workers import full_params


def _transport(kind: str, rank: int, world_size: int) -> Any:
    """The engine's ``transport`` argument for ``kind``: a name, or the 'cuda' transport's protocol on CPU."""
    if kind == "cuda-on-cpu":
        from tests.gpu.check_common import CpuSegmentsCudaTransport

        os.environ["ODC_HOST_ID"] = "one-host"
        return CpuSegmentsCudaTransport(rank, world_size, timeout=60.0)
    os.environ["ODC_HOST_ID"] = f"host-{rank}" if kind == "network" else "one-host"
    return kind


def _slow_down(rng: random.Random | None) -> None:
    """Sleep a random while at random microbatches: the ranks then finish each step in another order."""
    if rng is not None and rng.random() < 0.5:
        time.sleep(rng.uniform(0.01, 0.08))


def _fake_streams(engine: ODCEngine) -> Any:
    """Give ``engine`` the streams a GPU would have (`FakeStreams`, on CPU) and log its reads of contributions in
    the same log, so that the order of adds, waits and reads can be checked."""
    from odc_accelerate.engine.streams import LocalAddFence
    from tests.helpers.infra.fake_streams import FakeStreams

    streams = FakeStreams()
    engine._fence = LocalAddFence(streams)
    read = engine.transport.read

    def logged_read(peer: int, name: str, out: torch.Tensor) -> None:
        if "/to" in name:
            streams.mark("read", name)
        read(peer, name, out)

    engine.transport.read = logged_read
    return streams


def _train(
    model: torch.nn.Module, engine: ODCEngine, steps: list, rank: int, world_size: int, slow, streams: Any = None
) -> list[dict]:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    kept = []
    for step in steps:
        n_global = sum(ids.shape[1] - 1 for rank_mbs in step for ids in rank_mbs)
        scale = loss_scale(n_global, world_size) if n_global else 0.0
        kept.append(engine.memory_choices())
        for ids in step[rank]:
            _slow_down(slow)
            loss, _ = token_loss_sum(model, ids)
            if streams is not None:
                streams.current = "reduce-scatter"  # where FSDP2 runs the reduce-scatter hook on a GPU
            (loss * scale).backward()
            if streams is not None:
                streams.current = "default"
        _slow_down(slow)
        engine.pre_optimizer_step(optim)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optim.step()
        optim.zero_grad()
        engine.post_optimizer_step()
    return kept


def ordered_engine_runs(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec["plan"]`` once per entry of ``spec["configs"]`` (``name``, ``transport``, ``memory_policy``,
    ``slow_seed``: the rank ``spec["slow_rank"]`` sleeps at random microbatches, seeded so); return per configuration
    the full weights, the reduction, the memory choices per step, the last step's statistics and (on ``cuda-on-cpu``)
    the calls into the 'cuda' transport's atomic paths while it trained."""
    from tests.helpers.workers.ordered_workers import _AtomicCounter

    cfg = ToyConfig()
    steps = make_steps(spec["plan"], cfg.vocab, seed=1)
    counter = None
    out: dict[str, Any] = {}
    for config in spec["configs"]:
        transport = _transport(config["transport"], rank, world_size)
        model = shard_model(build_model(cfg, seed=0))
        engine = ODCEngine(
            model,
            transport=transport,
            timeout=60.0,
            reduction=config.get("reduction", "ordered"),
            memory_policy=config.get("memory_policy", "neither"),
        )
        if config["transport"] == "cuda-on-cpu" and counter is None:
            counter = _AtomicCounter()  # after set-up: counts every accumulate from here on
        seed = config.get("slow_seed")
        slow = random.Random(seed) if seed is not None and rank == spec.get("slow_rank", 0) else None
        streams = _fake_streams(engine) if config.get("fake_streams") else None
        kept = _train(model, engine, steps, rank, world_size, slow, streams)
        stats = engine.last_step_stats
        out[config["name"]] = {
            "params": full_params(model),
            "reduction": str(engine.reduction),
            "reduction_reason": engine.report().reduction_reason,
            "transport": engine.transport.name,
            "kept": kept,
            "buffers": sorted(engine._buffers),
            "stats": {k: getattr(stats, k) for k in ("bytes_read", "exchange_s", "scatters", "kept_grads")},
            "atomic_calls": dict(counter.calls) if counter is not None else None,
            "stream_log": streams.log if streams is not None else None,
        }
        engine.close()
        dist.barrier()
    return out


def ordered_hsdp_runs(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """HSDP (``spec["mesh"]`` = (replicas, shards), one emulated host per shard group) under the ordered reduction,
    once plainly and once with rank ``spec["slow_rank"]`` slowed at random microbatches; the full weights of each."""
    from torch.distributed.device_mesh import init_device_mesh

    replicas, shards = spec["mesh"]
    os.environ["ODC_HOST_ID"] = f"host{rank // shards}"
    cfg = ToyConfig()
    steps = make_steps(spec["plan"], cfg.vocab, seed=1)
    out: dict[str, Any] = {}
    for name, seed in (("plain", None), ("slowed", spec["slow_seed"])):
        mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("dp_replicate", "dp_shard"))
        model = shard_model(build_model(cfg, seed=0), mesh=mesh)
        engine = ODCEngine(model, timeout=60.0, reduction="ordered", replicate_bucket_bytes=60_000)
        slow = random.Random(seed) if seed is not None and rank == spec["slow_rank"] else None
        _train(model, engine, steps, rank, world_size, slow)
        out[name] = {"params": full_params(model), "reduction": str(engine.reduction), "replicas": engine.replicas}
        engine.close()
        dist.barrier()
    return out
