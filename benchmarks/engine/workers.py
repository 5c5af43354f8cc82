"""What runs inside the engine benchmark's 2 ranks: one model, optimizer and engine per arm, and the workers."""

from __future__ import annotations

import resource
import time
from typing import Any

# "fsdp_keep": FSDP2 keeping its parameters gathered and its gradients unsharded through accumulation
# (reshard_after_forward / reshard_after_backward off, gradient sync on the last microbatch only), its own equivalent
# of ODC's memory policy "both" ("odc_both").
ARMS = ("fsdp", "fsdp_keep", "odc", "odc_both", "odc_layersync", "limit")
#: arms only the profile and A/B drivers run (not in the stored table): "fsdp_floor" is FSDP2 with hooks that move no
#: data (`_floor_comms`), i.e. the per-group work any hook-based data path pays under FSDP2 before moving a byte.
EXTRA_ARMS = ("fsdp_floor",)
WORKLOADS = ("balanced", "imbalanced")


def _floor_comms():
    """An all-gather and a reduce-scatter for FSDP2 that move nothing: each returns a buffer allocated once per size
    (zeros: no denormals, and ``.grad += output`` keeps them zero) and leaves it as it is. FSDP2 still copies in and
    out, divides, views and accumulates ``.grad`` around them, with ODC's sum reduction."""
    import torch

    from odc_accelerate._compat.torch import fsdp as compat

    class _Cached:
        def __init__(self) -> None:
            self._buffers: dict[Any, torch.Tensor] = {}

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            key = (tuple(size), dtype, device)
            if key not in self._buffers:
                self._buffers[key] = torch.zeros(*size, dtype=dtype, device=device)
            return self._buffers[key]

    class FloorAllGather(_Cached, compat.AllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return None

    class FloorReduceScatter(_Cached, compat.ReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            return None

    return FloorAllGather, FloorReduceScatter


def _rank_plan(workload: str, rank: int, long: int, short: int) -> list[int]:
    if workload == "balanced" or rank == 0:
        return [long, short]
    return [short, long]


class _Arm:
    """One arm's model, optimizer and engine inside a worker process."""

    def __init__(self, arm: str, cfg: dict[str, Any]) -> None:
        import torch

        from odc_accelerate import ODCEngine
        from odc_accelerate.testing.models import ToyConfig, build_model, shard_model

        self.model = build_model(ToyConfig(**cfg), seed=0)
        self.engine = None
        self.keep = arm == "fsdp_keep"
        if arm != "limit":
            self.model = shard_model(self.model)
            if self.keep:
                self.model.set_reshard_after_forward(False)
                self.model.set_reshard_after_backward(False)
            if arm == "fsdp_floor":
                all_gather, reduce_scatter = _floor_comms()
                for module in self.model.modules():
                    if hasattr(module, "set_custom_all_gather"):
                        module.set_custom_all_gather(all_gather())
                        module.set_custom_reduce_scatter(reduce_scatter())
                        module.set_force_sum_reduction_for_comms(True)
            if arm.startswith("odc"):
                self.engine = ODCEngine(
                    self.model,
                    sync_every_hook=arm == "odc_layersync",
                    timeout=600,
                    memory_policy="both" if arm == "odc_both" else "neither",
                )
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, batches: list, n_global: int, world_size: int) -> tuple[float, float]:
        """One optimizer step between two barriers; returns (seconds, seconds blocked in ODC barriers)."""
        import torch.distributed as dist

        from odc_accelerate import loss_scale
        from odc_accelerate.testing.models import token_loss_sum

        dist.barrier()
        start = time.perf_counter()
        for i, ids in enumerate(batches):
            if self.keep:  # equal microbatch counts on every rank: FSDP2 reduces on the last one
                self.model.set_requires_gradient_sync(i == len(batches) - 1)
            loss, _ = token_loss_sum(self.model, ids)
            (loss * loss_scale(n_global, world_size)).backward()
        if self.engine is not None:
            self.engine.pre_optimizer_step()
        if self.keep:  # the gathered copies would be stale after the optimizer step
            for module in self.model.modules():
                if hasattr(module, "reshard"):
                    module.reshard()
        self.optim.step()
        self.optim.zero_grad()
        if self.engine is not None:
            self.engine.post_optimizer_step()
        elapsed = time.perf_counter() - start
        dist.barrier()
        wait = self.engine.last_step_stats.wait_s if self.engine is not None else 0.0
        return elapsed, wait

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _batches(workload: str, rank: int, opts: dict[str, Any], vocab: int, gen) -> tuple[list, int]:
    import torch

    lengths = _rank_plan(workload, rank, opts["long"], opts["short"])
    batches = [torch.randint(0, vocab, (1, n + 1), generator=gen) for n in lengths]
    return batches, 2 * sum(lengths)  # both ranks hold the same lengths in total


def timing_worker(rank: int, world_size: int, cfg: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """Every arm in the same process pair, interleaved step by step, so machine noise hits all arms alike."""
    import torch

    arms = {arm: _Arm(arm, cfg) for arm in ARMS}
    gen = torch.Generator().manual_seed(1234 + rank)
    times = {a: {w: [] for w in WORKLOADS} for a in ARMS}
    waits = {a: {w: [] for w in WORKLOADS} for a in ARMS}
    for step in range(opts["warmup"] + opts["steps"]):
        order = ARMS[step % len(ARMS) :] + ARMS[: step % len(ARMS)]  # rotate: no arm always runs first
        for arm in order:
            for workload in WORKLOADS if step % 2 else WORKLOADS[::-1]:
                batches, n_global = _batches(workload, rank, opts, cfg["vocab"], gen)
                elapsed, wait = arms[arm].step(batches, n_global, world_size)
                if step >= opts["warmup"]:
                    times[arm][workload].append(elapsed)
                    waits[arm][workload].append(wait)
    for a in arms.values():
        a.close()
    return {"times": times, "waits": waits}


def memory_worker(rank: int, world_size: int, arm: str, cfg: dict[str, Any], opts: dict[str, Any]) -> float:
    """Peak RSS (MB) of a process that runs only ``arm`` (peak RSS cannot be split between arms of one process)."""
    import torch

    model = _Arm(arm, cfg)
    gen = torch.Generator().manual_seed(1234 + rank)
    for _ in range(2):
        for workload in WORKLOADS:
            model.step(*_batches(workload, rank, opts, cfg["vocab"], gen), world_size)
    model.close()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


#: the engine's own step figures that the profile reports beside the ops (seconds, per step)
ENGINE_PHASES = ("gather_s", "scatter_s", "fold_s", "publish_s", "wait_s")


def profile_worker(
    rank: int, world_size: int, arms: list[str], cfg: dict[str, Any], opts: dict[str, Any], steps: int
) -> dict[str, Any]:
    """Per arm, each op's self CPU time per balanced step (torch.profiler, averaged over ``steps`` profiled steps, the
    arms interleaved as in `timing_worker`), the step's wall time and, for ODC arms, the engine's own phases."""
    import collections
    import statistics

    import torch
    from torch.profiler import ProfilerActivity, profile

    built = {arm: _Arm(arm, cfg) for arm in arms}
    gen = torch.Generator().manual_seed(1234 + rank)
    ops = {arm: collections.Counter() for arm in arms}
    wall: dict[str, list[float]] = {arm: [] for arm in arms}
    phases: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    for step in range(opts["warmup"] + steps):
        for arm in arms[step % len(arms) :] + arms[: step % len(arms)]:
            batches, n_global = _batches("balanced", rank, opts, cfg["vocab"], gen)
            if step < opts["warmup"]:
                built[arm].step(batches, n_global, world_size)
                continue
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                elapsed, _ = built[arm].step(batches, n_global, world_size)
            wall[arm].append(elapsed)
            for event in prof.key_averages():
                ops[arm][event.key] += event.self_cpu_time_total / 1e3 / steps  # microseconds -> ms per step
            engine = built[arm].engine
            if engine is not None:
                phases[arm].append({k: getattr(engine.last_step_stats, k) for k in ENGINE_PHASES})
    for a in built.values():
        a.close()
    return {
        "ops_ms": {arm: dict(c) for arm, c in ops.items()},
        "wall_ms": {arm: statistics.median(w) * 1e3 for arm, w in wall.items()},
        "phases_ms": {
            arm: {k: statistics.median(p[k] for p in rows) * 1e3 for k in ENGINE_PHASES}
            for arm, rows in phases.items()
            if rows
        },
    }
