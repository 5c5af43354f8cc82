"""Engine-level check of the 'cuda' transport on one GPU: ``scripts/gpu_check.sh [OUT_DIR]``.

Runs 2 processes on the one GPU (gloo process group, ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``; 8 in
``ranks8``), each case in fresh processes, and writes ``results.json`` and ``summary.txt`` to the output folder:

* ``environment``: torch, CUDA, the GPU and what the transport's device checks see;
* ``refusals``: a shared GPU without the override, a non-CUDA symmetric-memory backend and too little free memory are
  refused on every rank with a message naming the fix (``"cuda"`` and ``"auto"``), before any allocation;
* ``parity``: the toy LM with unequal microbatch counts per rank (1 and 4) against one process summing the same
  microbatches: fp32 (gradients and parameters after 3 AdamW steps); bf16 parameters with an fp32 reduce dtype (checks
  the reference: same bf16 gradients, summed in fp32); bf16 parameters with a bf16 reduce dtype, accumulated in fp32
  (the default) and in bf16 (``accumulate_dtype=torch.bfloat16``); ``auto`` picks the transport and its kernel;
* ``ranks8``: 8 processes on the one GPU: the fp32 parity with 0 to 3 microbatches per rank, the same steps under the
  ``dynamic`` plan (every microbatch claimed exactly once, the same parameters), the claim counter with 8 ranks
  claiming at once, and 7 ranks adding into one owner's accumulators at once, exact against the sum;
* ``memory``: two engines made and closed in turn in one process, the baseline taken after FSDP2's lazy init: per
  rank, what the GPU loses to the second engine equals the transport's report (within 8 MiB) and ``close()`` gives it
  all back (within 4 MiB); what the first engine takes beyond its report and never gives back (CUDA context growth,
  torch's ``CUDAPeerAllocInfo``) is reported as ``uncounted_first_engine_per_rank``;
* ``memory_policy``: the engine's peak memory per rank (torch's allocator) under the step memory policy ``neither``
  against what a rank may hold: 4 shards (parameters, gradients, AdamW's moments; fp32) + FSDP2's working set + one
  microbatch's activations + the transport's staging pool (its segment is outside torch's allocator), and ``both``
  beside it; the same worker and bound as the CPU test (`tests/multiprocess/test_engine_memory_policy.py`);
* ``ordered``: the ``ordered`` gradient reduction against ``atomic`` on the toy LM with unequal microbatch counts per
  rank: step time of each, two engines in one launch stepping in turn (``atomic ordered``, then ``ordered atomic``, ...:
  the median of each one's steps after a warm-up, same definition for both; the ordered exchange's time and bytes
  from the engine's `StepStats`), the parameters of the two equal to rounding, and two further ``ordered`` runs, each
  in fresh processes with deterministic algorithms on and a different rank slowed at random microbatches, ending with
  bitwise-identical parameters (a SHA-256 of every parameter shard on every rank);
* ``speed``: read and atomic-accumulate bandwidth between the two ranks; every accumulate path side by side at 1 GiB
  of source, each rank timed alone (`accumulate_bench`: ``index_add_``, the kernel, a non-atomic add, copy,
  copy-then-add, fp32 and bf16 sources, and the kernel's goals against the first and the third). Both ranks share one
  GPU, so these figures are single-GPU copy and atomic throughput, not NVLink.

With ``--device cpu`` the parity, ranks8 and ordered cases run, on CPU: the ``shm`` transport (parity), and the 'cuda'
transport's protocol (segment plan, fp32 accumulators, chunked adds through the staging pool, the claim counter) over
shared memory instead of GPU symmetric memory (`CpuSegmentsCudaTransport`). That checks this harness and the engine's
handling of widened accumulators without a GPU. The exit code is 0 when every check passed.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import fcntl
import gc
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from odc_accelerate.testing import launch
from odc_accelerate.testing.models import ToyConfig, build_model, make_steps, shard_model, token_loss_sum
from odc_accelerate.transport import BufferSpec, CudaTransport, ShmTransport
from odc_accelerate.transport.cuda import DeviceFacts

OVERLAP_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"
SMALL = dict(vocab=128, dim=64, heads=4, layers=3)
MEDIUM = dict(vocab=8192, dim=1024, heads=16, layers=4)
# rank 0 runs 1 microbatch per step, rank 1 runs 4
PLAN = [[[12], [9, 15, 7, 11]], [[16], [5, 13, 10, 8]], [[6], [14, 9, 12, 10]]]
CASES = ("refusals", "parity", "ranks8", "memory", "ordered", "memory_policy", "speed")
CPU_CASES = ("parity", "ranks8", "ordered")  # with --device cpu: over shared memory instead of the GPU
#: the eight-rank case: 8 processes on the one device
RANKS8 = 8
#: the ordered case: per device, the model, the microbatch lengths of rank 0 and rank 1 in every step, and the steps
#: (the first is a warm-up, not timed). Unequal counts per rank: each owner sums a 1-microbatch and a 3-microbatch
#: contribution. The CPU sizes keep the dry run short; its times are the harness's, not a measurement.
ORDERED = {
    "cuda": dict(cfg=MEDIUM, lengths=[[512], [384, 256, 448]], steps=9),
    "cpu": dict(cfg=SMALL, lengths=[[12], [9, 15, 7]], steps=3),
}
# 3 steps x 8 ranks: 0 to 3 microbatches per rank, two ranks with none in every step
PLAN8 = [
    [[12], [9, 15, 7], [], [11, 5], [16], [8, 13, 6], [], [10]],
    [[5, 14], [], [9], [13, 7, 11], [6], [], [15, 8], [12]],
    [[], [16], [10, 4], [7], [9, 12, 5], [14], [11], []],
]


# ------------------------------------------------------------------------------------------------------- helpers
def _device(kind: str) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _policy(precision: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    if precision == "bf16-fp32-reduce":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _math_sdpa():
    """Deterministic attention kernels on both sides of a parity comparison."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _local(t: torch.Tensor) -> np.ndarray:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().float().cpu().numpy().copy()


def _transport(spec: dict[str, Any], rank: int, world_size: int, device: torch.device):
    name = spec.get("transport", "auto")
    narrow = torch.bfloat16 if name.endswith("bf16-acc") else None
    if name.startswith("cuda-on-cpu"):
        return CpuSegmentsCudaTransport(rank, world_size, timeout=120.0, accumulate_dtype=narrow)
    if name == "cuda-bf16-acc":
        return CudaTransport(rank, world_size, timeout=120.0, device=device, accumulate_dtype=narrow)
    if name == "cuda-index-add":  # the accumulate kernel's fallback, for a side-by-side engine step
        return CudaTransport(rank, world_size, timeout=120.0, device=device, accumulate_kernel=False)
    return name


class CpuSegmentsCudaTransport(CudaTransport):
    """The 'cuda' transport's protocol on CPU: its segment plan (fp32 accumulators), chunked adds through the staging
    pool, flush and barrier, over ``/dev/shm`` segments instead of GPU symmetric memory.

    Lets ``--device cpu`` run the engine with widened accumulators without a GPU. CPU ``index_add_`` is not atomic
    across processes, so each add holds the owner's segment lock (on a GPU the atomics make adds safe without one).
    """

    name = "cuda-on-cpu"

    def __init__(self, rank: int, world_size: int, *, free_bytes: int = 2**62, **kwargs: Any) -> None:
        super().__init__(rank, world_size, device=torch.device("cpu"), **kwargs)
        self._shm: ShmTransport | None = None
        self.free_bytes = free_bytes  # the stated free memory of each emulated GPU

    def _local_facts(self, device: torch.device, kernel: tuple[bool, str]) -> DeviceFacts:
        # Each rank its own emulated GPU, every one visible and peer-accessible with native atomics; gathered from
        # every rank as on GPUs, with whether the accumulate kernel passed its set-up probe here.
        gpus = tuple(f"cpu-{r}" for r in range(self.world_size))
        yes = (True,) * self.world_size
        return DeviceFacts(
            host="cpu",
            uuid=gpus[self.rank],
            visible=gpus,
            access=yes,
            atomics=yes,
            free_bytes=self.free_bytes,
            accumulate_kernel=kernel[0],
            accumulate_kernel_reason=kernel[1],
        )

    def _free_bytes(self, device: torch.device) -> int:
        return self.free_bytes

    def _allocate_segment(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)  # the shared-memory segments are made by `_exchange_segments`

    def _exchange_segments(self, own: torch.Tensor, nbytes: int) -> list[torch.Tensor]:
        self._shm = ShmTransport(self.rank, self.world_size, timeout=self.timeout, group=self._group)
        self._shm.register({"segment": BufferSpec(numel=nbytes, dtype=torch.uint8)})
        return [self._shm._views[peer]["segment"] for peer in range(self.world_size)]

    def accumulate(self, owner: int, name: str, src: torch.Tensor) -> None:
        fd, index = self._shm._lock_fds[owner], self._shm._lock_index["segment"]
        self._shm._lock(fd, index, owner, name)
        try:
            super().accumulate(owner, name, src)
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, index)

    def close(self) -> None:
        super().close()
        if self._shm is not None:
            self._shm.close()


# ------------------------------------------------------------------------------------------------------- workers
def train_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train the toy LM with ODC for ``spec["plan"]``; return this rank's gradient and parameter shards.

    With ``spec["dynamic"]`` the step's microbatches (every rank's, in plan order: the same list on every rank) form
    one queue that the ranks claim from while the step runs (``engine.claim_microbatches``, the ``dynamic`` plan);
    ``claimed`` lists the indices this rank ran in each step.
    """
    from odc_accelerate.engine import ODCEngine
    from odc_accelerate.loss import loss_scale

    device = _device(spec["device"])
    cfg = ToyConfig(**spec["cfg"])
    model = shard_model(build_model(cfg, seed=0).to(device), mp_policy=_policy(spec["precision"]))
    engine = ODCEngine(model, transport=_transport(spec, rank, world_size, device), timeout=120.0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    first_grads: dict[str, np.ndarray] = {}
    step_s, claimed = [], []
    with _math_sdpa():
        for index, step in enumerate(make_steps(spec["plan"], cfg.vocab, seed=1)):
            _sync(device)
            start = time.perf_counter()
            n_global = sum(ids.shape[1] - 1 for mbs in step for ids in mbs)
            if spec.get("dynamic"):
                queue = [ids for mbs in step for ids in mbs]
                mine = []
                for i in engine.claim_microbatches(len(queue)):
                    mine.append(i)
                    loss, _ = token_loss_sum(model, queue[i].to(device))
                    (loss * loss_scale(n_global, world_size)).backward()
                claimed.append(mine)
            else:
                for ids in step[rank]:
                    loss, _ = token_loss_sum(model, ids.to(device))
                    (loss * loss_scale(n_global, world_size)).backward()
            engine.pre_optimizer_step()
            if index == 0:
                first_grads = {n: _local(p.grad) for n, p in model.named_parameters() if p.grad is not None}
            optim.step()
            optim.zero_grad()
            engine.post_optimizer_step()
            _sync(device)
            step_s.append(time.perf_counter() - start)
    stats = engine.last_step_stats
    out = {
        "grads": first_grads,
        "params": {n: _local(p) for n, p in model.named_parameters()},
        "transport": engine.transport.name,
        "accumulate_path": getattr(engine.transport, "accumulate_path", None),
        "memory_report": engine.transport.memory_report(),
        "stats": dataclasses.asdict(stats) if stats is not None else None,
        "step_s": step_s,
        "claimed": claimed,
    }
    engine.close()
    return out


def _param_hashes(model: torch.nn.Module) -> dict[str, str]:
    """SHA-256 of this rank's shard of every parameter, bit for bit."""
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        data = local.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        out[name] = hashlib.sha256(data).hexdigest()
    return out


def ordered_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train the toy LM under each reduction of ``spec["reductions"]``, one engine each, stepping in turn.

    Step ``i`` runs every engine once, in the order of ``spec["reductions"]`` for even ``i`` and reversed for odd ``i``
    (``A B``, ``B A``, ...), so that neither runs always first. A step is timed the same way for every engine: from a
    barrier with the device synchronised to the end of ``post_optimizer_step`` (its closing barrier) with the device
    synchronised. ``spec["slow_rank"]``: that rank sleeps 0 to 20 ms (a seeded random draw) after some microbatches,
    so that the ranks reach the step boundary in varying order. ``spec["deterministic"]``: deterministic algorithms on
    (``warn_only``: an op without a deterministic version warns), which the ``atomic`` reduction refuses on a GPU.
    Returns per reduction: step times, the engine's exchange time and bytes read per step, the hash of every
    parameter shard before and after training, and the shards themselves.
    """
    from odc_accelerate.engine import ODCEngine
    from odc_accelerate.loss import loss_scale

    device = _device(spec["device"])
    if spec.get("deterministic"):
        torch.use_deterministic_algorithms(True, warn_only=True)
    cfg = ToyConfig(**spec["cfg"])
    reductions = list(spec["reductions"])
    arms: dict[str, Any] = {}
    for reduction in reductions:
        model = shard_model(build_model(cfg, seed=0).to(device), mp_policy=_policy("fp32"))
        transport = _transport(spec, rank, world_size, device)
        engine = ODCEngine(model, transport=transport, reduction=reduction, timeout=120.0)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        arms[reduction] = {"model": model, "engine": engine, "optim": optim, "initial": _param_hashes(model)}
    plan = [spec["lengths"]] * spec["steps"]
    slow = random.Random(spec.get("seed", 0))
    figures: dict[str, dict[str, list]] = {r: {"step_s": [], "exchange_s": [], "bytes_read": []} for r in reductions}
    with _math_sdpa():
        for index, step in enumerate(make_steps(plan, cfg.vocab, seed=1)):
            n_global = sum(ids.shape[1] - 1 for mbs in step for ids in mbs)
            for reduction in reductions if index % 2 == 0 else reversed(reductions):
                arm = arms[reduction]
                model, engine, optim = arm["model"], arm["engine"], arm["optim"]
                _sync(device)
                dist.barrier()
                start = time.perf_counter()
                for ids in step[rank]:
                    loss, _ = token_loss_sum(model, ids.to(device))
                    (loss * loss_scale(n_global, world_size)).backward()
                    if rank == spec.get("slow_rank") and slow.random() < 0.5:
                        time.sleep(slow.uniform(0.0, 0.02))
                engine.pre_optimizer_step()
                optim.step()
                optim.zero_grad()
                engine.post_optimizer_step()
                _sync(device)
                figures[reduction]["step_s"].append(time.perf_counter() - start)
                stats = engine.last_step_stats
                figures[reduction]["exchange_s"].append(stats.exchange_s if stats is not None else None)
                figures[reduction]["bytes_read"].append(stats.bytes_read if stats is not None else None)
    out: dict[str, Any] = {"deterministic": torch.are_deterministic_algorithms_enabled()}
    for reduction, arm in arms.items():
        out[reduction] = {
            **figures[reduction],
            "reduction": str(getattr(arm["engine"].reduction, "value", arm["engine"].reduction)),
            "transport": arm["engine"].transport.name,
            "initial": arm["initial"],
            "hashes": _param_hashes(arm["model"]),
            "params": {n: _local(p) for n, p in arm["model"].named_parameters()},
        }
        arm["engine"].close()
    return out


def reference(spec: dict[str, Any]) -> dict[str, Any]:
    """One process runs every rank's microbatches: first-step gradients and parameters after every step.

    With a bf16 policy the microbatches run on a bf16 copy of the model (what FSDP2's mixed precision computes with)
    and their bf16 gradients are summed in fp64, so the comparison isolates how ODC accumulates.
    """
    device = _device(spec["device"])
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the ranks run: CPU kernels block their sums by thread count
    cfg = ToyConfig(**spec["cfg"])
    world = len(spec["plan"][0])
    model = build_model(cfg, seed=0).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    first_grads = {}
    with _math_sdpa():
        for index, step in enumerate(make_steps(spec["plan"], cfg.vocab, seed=1)):
            n_global = sum(ids.shape[1] - 1 for mbs in step for ids in mbs)
            compute = copy.deepcopy(model).to(torch.bfloat16) if spec["precision"] != "fp32" else model
            sums = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
            for mbs in step:
                for ids in mbs:
                    loss, _ = token_loss_sum(compute, ids.to(device))
                    (loss * (world / n_global)).backward()  # as each rank scales it; the fold divides by world
                    for n, p in compute.named_parameters():
                        sums[n] += p.grad.double()
                        p.grad = None
            for n, p in model.named_parameters():
                p.grad = (sums[n] / world).to(p.dtype)
            if index == 0:
                first_grads = {n: (g / world).float().cpu().numpy().copy() for n, g in sums.items()}
            optim.step()
            optim.zero_grad()
    params = {n: p.detach().float().cpu().numpy().copy() for n, p in model.named_parameters()}
    return {"grads": first_grads, "params": params}


def refusal_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, str]:
    """Build an engine that must be refused; return each attempt's error text ('' if it was not refused) and its
    traceback."""
    from odc_accelerate._compat.torch import fsdp as fsdp_compat
    from odc_accelerate.engine import ODCEngine

    device = _device("cuda")
    cfg = ToyConfig(**spec["cfg"])
    model = shard_model(build_model(cfg, seed=0).to(device), mp_policy=_policy("fp32"))
    filler = None
    if spec.get("leave_free_mib") is not None:
        # FSDP2's lazy init first (its streams need a little GPU memory), so that the transport's check is what meets
        # the full GPU; the engine turns an out-of-memory error in FSDP2's own lazy init into a refusal as well.
        fsdp_compat.lazy_init(model)
        dist.barrier()
        if rank == 0:  # leave less free memory than the two transports need (the ranks share this GPU)
            free, _ = torch.cuda.mem_get_info(device)
            filler = torch.empty(max(free - spec["leave_free_mib"] * 2**20, 0), dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
        dist.barrier()
    out = {}
    for name in spec["transports"]:
        try:
            engine = ODCEngine(model, transport=_transport({**spec, "transport": name}, rank, world_size, device))
        except Exception as err:  # the refusal under test
            out[name] = f"{type(err).__name__}: {err}"
            out[f"traceback/{name}"] = "".join(traceback.format_exception(err))
        else:
            engine.close()
            out[name] = ""
    del filler
    dist.barrier()
    return out


def memory_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Free GPU memory before, with and after each of two engines made and closed in turn; the transport's report.

    The baseline is taken after FSDP2's lazy initialisation (its streams and buffers are FSDP2's, not ODC's). The
    first engine of a process also grows what nothing gives back before the process ends: the CUDA context (kernels
    loaded on first use) and torch's peer tables of symmetric memory (``CUDAPeerAllocInfo``, which has no
    destructor). The second engine shows what ODC itself takes and returns.
    """
    from odc_accelerate._compat.torch import fsdp as fsdp_compat
    from odc_accelerate.engine import ODCEngine

    device = _device("cuda")
    cfg = ToyConfig(**spec["cfg"])
    model = shard_model(build_model(cfg, seed=0).to(device), mp_policy=_policy("bf16"))
    fsdp_compat.lazy_init(model)

    def measure() -> dict[str, int]:
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        dist.barrier()  # both ranks (one GPU) at the same point
        free, _ = torch.cuda.mem_get_info(device)
        dist.barrier()
        return {"free": int(free), "allocated": int(torch.cuda.memory_allocated(device))}

    cycles = []
    for _ in range(spec.get("cycles", 2)):
        before = measure()
        engine = ODCEngine(model)
        with_engine = measure()
        report = engine.transport.memory_report()
        engine.close()
        del engine
        after = measure()
        cycles.append({"before": before, "with_engine": with_engine, "after_close": after, "report": report})
    return {"cycles": cycles}


def speed_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Bandwidth of ``read`` and ``accumulate`` (bf16 into fp32, atomic) between the two ranks, and a sum check."""
    device = _device("cuda")
    numel, iters = spec["numel"], spec["iters"]
    transport = CudaTransport(rank, world_size, timeout=120.0, device=device)
    specs = {
        "p": BufferSpec(numel=numel, dtype=torch.bfloat16),
        "g": BufferSpec(numel=numel, dtype=torch.bfloat16, accumulated=True),
    }
    own = transport.register(specs)
    own["p"].fill_(float(rank + 1))
    gen = torch.Generator(device=device).manual_seed(rank)
    src = torch.randn(numel, generator=gen, device=device).to(torch.bfloat16)
    out = torch.empty(numel, dtype=torch.bfloat16, device=device)
    peer = (rank + 1) % world_size
    transport.barrier()
    results: dict[str, Any] = {"memory_report": transport.memory_report(), "chunk_numel": transport.plan.chunk_numel}
    ops = (
        ("read", lambda: transport.read(peer, "p", out)),
        ("accumulate", lambda: transport.accumulate(peer, "g", src)),
    )
    for what, op in ops:
        op()  # warm-up (the accumulate's warm-up counts in the sum check below)
        transport.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            op()
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        results[f"{what}_GBps"] = iters * numel * 2 / seconds / 1e9  # bf16 bytes moved per call
        results[f"{what}_ms"] = seconds / iters * 1e3
        transport.barrier()
    results["read_ok"] = bool(torch.equal(out, torch.full_like(out, float(peer + 1))))
    # Every peer added its src (iters + 1) times into this rank's fp32 accumulator.
    expected = torch.zeros(numel, dtype=torch.float64, device=device)
    for sender in range(world_size):
        if sender != rank:
            g = torch.Generator(device=device).manual_seed(sender)
            expected += torch.randn(numel, generator=g, device=device).to(torch.bfloat16).double() * (iters + 1)
    err = (own["g"].double() - expected).abs().max().item()
    results["accumulate_max_abs_err"] = err
    results["accumulate_ok"] = err <= 1e-4 * (iters + 1)
    transport.close()
    return results


def _own_transport(name: str, rank: int, world_size: int, device: torch.device):
    """A transport instance for the transport-level workers: ``cuda`` (the GPU), ``cuda-on-cpu`` (its protocol over
    shared memory) or ``shm``."""
    if name == "cuda":
        return CudaTransport(rank, world_size, timeout=120.0, device=device)
    if name == "cuda-on-cpu":
        return CpuSegmentsCudaTransport(rank, world_size, timeout=120.0)
    if name == "shm":
        return ShmTransport(rank, world_size, timeout=120.0)
    raise ValueError(f"unknown transport {name!r} for a transport-level worker")


def _small_integers(seed: int, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Integers in [-8, 8]: a sum of a few hundred of them is exact in bf16 and fp32, whatever the order of the adds."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(-8, 9, (numel,), generator=gen, dtype=torch.int32).to(dtype).to(device)


def _wait_for(path: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{os.path.basename(path)} did not appear within {timeout:.0f} s")
        time.sleep(0.002)


def transport8_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Claims and concurrent adds through one transport, every rank at once.

    * claims (the ``dynamic`` plan's counter, `claims.claim_counter`), one round each: ``race`` (800 indices; after
      its first claim each rank waits until every peer has claimed one, so that all take part), ``none`` (6 indices
      that rank 0 drains before any other rank starts: they claim none), ``empty`` (0 indices) and ``again`` (the next
      round starts at 0: ``race`` once more). Returns the indices this rank claimed in each round;
    * adds: every rank but ``spec["owner"]`` adds its own source into the owner's accumulators ``spec["iters"]``
      times, an fp32 and a bf16 source, all senders at once (one barrier before). The sources are small integers
      (`_small_integers`), so the owner's sums must equal the exact one; every other rank's accumulators must still be
      zero.
    """
    from odc_accelerate.transport.claims import claim_counter, claim_indices

    device = _device(spec["device"])
    transport = _own_transport(spec["transport"], rank, world_size, device)
    numel, iters, owner = spec["numel"], spec["iters"], spec["owner"]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    own = transport.register({name: BufferSpec(numel=numel, dtype=d, accumulated=True) for name, d in dtypes.items()})
    out: dict[str, Any] = {"transport": transport.name, "accumulate_path": getattr(transport, "accumulate_path", None)}

    counter = claim_counter(transport)
    out["counter"] = type(counter).__name__
    flags = spec["flag_dir"]
    claims: dict[str, list[int]] = {}
    for round_no, (case, count) in enumerate((("race", 800), ("none", 6), ("empty", 0), ("again", 800)), start=1):
        if case == "none" and rank != 0:
            _wait_for(os.path.join(flags, "none.drained"))
        mine = []
        for index in claim_indices(counter, round_no, count):
            mine.append(index)
            if case in ("race", "again"):
                if len(mine) == 1:
                    open(os.path.join(flags, f"{case}.rank{rank}"), "w").close()
                    for peer in range(world_size):
                        _wait_for(os.path.join(flags, f"{case}.rank{peer}"))
                time.sleep(1e-4)  # a little work per index: the ranks claim at the same time
        if case == "none" and rank == 0:
            open(os.path.join(flags, "none.drained"), "w").close()
        claims[case] = mine
        transport.barrier()  # the step's barrier: every claim of this round is done on every rank
    out["claims"] = claims

    transport.barrier()  # every sender starts at once
    if rank != owner:
        for name, dtype in dtypes.items():
            src = _small_integers(rank, numel, dtype, device)
            for _ in range(iters):
                transport.accumulate(owner, name, src)
    transport.barrier()  # every add issued before it has landed
    for name, dtype in dtypes.items():
        got = own[name].double().cpu()
        if rank == owner:
            senders = [r for r in range(world_size) if r != owner]
            expected = sum(_small_integers(r, numel, dtype, "cpu").double() for r in senders) * iters
            out[name] = {
                "exact": bool(torch.equal(got, expected)),
                "max_abs_err": float((got - expected).abs().max()),
                "accumulator_dtype": str(own[name].dtype).removeprefix("torch."),
            }
        else:
            out[name] = {"untouched": not bool(got.any())}
    out["accumulate_path"] = getattr(transport, "accumulate_path", None)
    transport.barrier()
    del own
    transport.close()
    return out


# ------------------------------------------------------------------------------------------------------- the cases
def _compare(ranks: list[dict[str, np.ndarray]], ref: dict[str, np.ndarray], world: int) -> dict[str, float]:
    """Max absolute and norm-relative difference of every rank's shard against the reference's matching chunk."""
    worst_abs, diff2, ref2 = 0.0, 0.0, 0.0
    for name, full in ref.items():
        chunks = list(torch.chunk(torch.from_numpy(full), world, dim=0))
        for rank, shards in enumerate(ranks):
            expected = chunks[rank].numpy() if rank < len(chunks) else full[0:0]
            got = shards.get(name)
            if got is None or got.shape != expected.shape:
                shape = None if got is None else got.shape
                raise AssertionError(f"{name}: rank {rank} holds a shard of shape {shape}, expected {expected.shape}")
            d = got.astype(np.float64) - expected.astype(np.float64)
            worst_abs = max(worst_abs, float(np.abs(d).max(initial=0.0)))
            diff2 += float((d**2).sum())
            ref2 += float((expected.astype(np.float64) ** 2).sum())
    return {"max_abs": worst_abs, "rel": (diff2 / max(ref2, 1e-300)) ** 0.5}


def case_parity(device: str) -> dict[str, Any]:
    env = {OVERLAP_ENV: "1"}
    if device == "cpu":  # the accumulate kernel runs on CPU tensors under Triton's interpreter (fp32 accumulators)
        env["TRITON_INTERPRET"] = "1"
    # The 'cuda' transport accumulating in fp32 (its default) and in bf16; on CPU its protocol over shared memory.
    wide, narrow = ("auto", "cuda-bf16-acc") if device == "cuda" else ("cuda-on-cpu", "cuda-on-cpu-bf16-acc")
    runs = {"fp32": ["auto", wide], "bf16-fp32-reduce": [wide], "bf16": [wide, narrow]}
    out: dict[str, Any] = {}
    for precision, transports in runs.items():
        spec = dict(device=device, cfg=SMALL, plan=PLAN, precision=precision)
        ref = reference(spec)
        for name in dict.fromkeys(transports):
            ranks = launch(train_worker, 2, {**spec, "transport": name}, timeout=300, env=env)
            out[f"{precision}/{name}"] = {
                "transport": ranks[0]["transport"],
                "accumulate_path": ranks[0]["accumulate_path"],
                "grad": _compare([r["grads"] for r in ranks], ref["grads"], 2),
                "params_after_3_steps": _compare([r["params"] for r in ranks], ref["params"], 2),
                "memory_report": ranks[0]["memory_report"],
            }
    checks = {}
    for name in dict.fromkeys(runs["fp32"]):
        res = out[f"fp32/{name}"]
        checks[f"fp32 gradients, {res['transport']} (rel < 1e-5)"] = res["grad"]["rel"] < 1e-5
        checks[f"fp32 parameters after 3 AdamW steps, {res['transport']} (max abs < 1e-4)"] = (
            res["params_after_3_steps"]["max_abs"] < 1e-4
        )
    # bf16 compute with an fp32 reduce dtype checks the reference itself (same bf16 gradients, summed in fp32).
    checks["bf16 params, fp32 reduce dtype: gradients (rel < 1e-4)"] = (
        out[f"bf16-fp32-reduce/{wide}"]["grad"]["rel"] < 1e-4
    )
    checks["bf16 reduce dtype, accumulated in fp32 (default): gradients (rel < 1e-4)"] = (
        out[f"bf16/{wide}"]["grad"]["rel"] < 1e-4
    )
    checks["fp32 accumulation closer to the exact sum than bf16 accumulation"] = (
        out[f"bf16/{wide}"]["grad"]["rel"] < out[f"bf16/{narrow}"]["grad"]["rel"]
    )
    if device == "cuda":
        checks["'auto' picked the cuda transport"] = out["fp32/auto"]["transport"] == "cuda"
        checks["the engine's 'auto' accumulates with the kernel"] = out["fp32/auto"]["accumulate_path"] == "kernel"
    out["checks"] = checks
    return out


def case_ranks8(device: str, transports: list[str] | None = None) -> dict[str, Any]:
    """Eight ranks on the one device (on a GPU: 8 processes sharing it over gloo).

    Per transport (on a GPU the engine's ``auto``, i.e. ``cuda``; on CPU the 'cuda' transport's protocol over shared
    memory): the toy LM with 0 to 3 microbatches per rank (`PLAN8`) against one process summing the same
    microbatches (fp32 gradients and parameters after 3 AdamW steps); the same steps under the ``dynamic`` plan (each
    step's microbatches claimed from one queue while the step runs): every microbatch claimed exactly once, and the
    same parameters; the claim counter with 8 ranks claiming at once; 7 ranks adding into one owner's accumulators
    at once, exact against the sum computed here.
    """
    env = {OVERLAP_ENV: "1"}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    names = transports or (["auto"] if device == "cuda" else ["cuda-on-cpu"])
    spec = dict(device=device, cfg=SMALL, plan=PLAN8, precision="fp32")
    ref = reference(spec)
    queue_lengths = [sum(len(mbs) for mbs in step) for step in PLAN8]
    out: dict[str, Any] = {"plan_microbatches_per_rank": [[len(mbs) for mbs in step] for step in PLAN8]}
    checks: dict[str, bool] = {}
    with tempfile.TemporaryDirectory(prefix="odc_ranks8_") as flags:
        for name in names:
            static = launch(train_worker, RANKS8, {**spec, "transport": name}, timeout=300, env=env)
            dynamic = launch(train_worker, RANKS8, {**spec, "transport": name, "dynamic": True}, timeout=300, env=env)
            own = "cuda" if name == "auto" else name.removesuffix("-bf16-acc")
            flag_dir = os.path.join(flags, own)
            os.makedirs(flag_dir)
            numel = 3 * 2**20 + 12345 if device == "cuda" else 40_003  # several staging chunks, no round size
            tspec = dict(device=device, transport=own, numel=numel, iters=3, owner=3, flag_dir=flag_dir)
            ranks = launch(transport8_worker, RANKS8, tspec, timeout=300, env=env)
            t = static[0]["transport"]
            claimed = [[r["claimed"][step] for r in dynamic] for step in range(len(PLAN8))]
            res = out[t] = {
                "accumulate_path": static[0]["accumulate_path"],
                "grad": _compare([r["grads"] for r in static], ref["grads"], RANKS8),
                "params_after_3_steps": _compare([r["params"] for r in static], ref["params"], RANKS8),
                "dynamic_params_after_3_steps": _compare([r["params"] for r in dynamic], ref["params"], RANKS8),
                "dynamic_claimed_per_rank": [[len(c) for c in step] for step in claimed],
                "claims_per_rank": {c: [len(r["claims"][c]) for r in ranks] for c in ("race", "none", "again")},
                "counter": ranks[0]["counter"],
                "accumulate_into_one": {k: ranks[tspec["owner"]][k] for k in ("fp32", "bf16")},
                "transport_accumulate_path": ranks[0]["accumulate_path"],
            }
            checks[f"8 ranks, 0 to 3 microbatches each: fp32 gradients, {t} (rel < 1e-5)"] = res["grad"]["rel"] < 1e-5
            checks[f"8 ranks: fp32 parameters after 3 AdamW steps, {t} (max abs < 1e-4)"] = (
                res["params_after_3_steps"]["max_abs"] < 1e-4
            )
            checks[f"dynamic plan, 8 ranks: every microbatch claimed exactly once in every step, {t}"] = all(
                sorted(i for rank in step for i in rank) == list(range(n))
                for step, n in zip(claimed, queue_lengths, strict=True)
            )
            checks[f"dynamic plan, 8 ranks: parameters after 3 AdamW steps, {t} (max abs < 1e-4)"] = (
                res["dynamic_params_after_3_steps"]["max_abs"] < 1e-4
            )
            rounds = {c: [r["claims"][c] for r in ranks] for c in ("race", "none", "empty", "again")}
            checks[f"claims, 8 ranks at once: every index exactly once, each rank's in increasing order, {t}"] = all(
                sorted(i for mine in rounds[c] for i in mine) == list(range(800))
                and all(mine and mine == sorted(mine) for mine in rounds[c])
                for c in ("race", "again")
            )
            checks[f"claims: ranks starting after the queue is drained get none; an empty round gives none, {t}"] = (
                rounds["none"][0] == list(range(6)) and not any(rounds["none"][1:]) and not any(rounds["empty"])
            )
            for dtype in ("fp32", "bf16"):
                checks[f"7 ranks adding into one owner's accumulator at once: exact, {dtype} source, {t}"] = ranks[
                    tspec["owner"]
                ][dtype]["exact"]
            checks[f"7 ranks adding into one owner's: no other rank's accumulator touched, {t}"] = all(
                r[d]["untouched"] for i, r in enumerate(ranks) if i != tspec["owner"] for d in ("fp32", "bf16")
            )
    out["checks"] = checks
    return out


def case_ordered(device: str) -> dict[str, Any]:
    """The ``ordered`` reduction against ``atomic`` on 2 ranks sharing the device (`ordered_worker`).

    One launch runs both reductions, stepping in turn: each one's median step time over its steps after the first (the
    same definition for both; the figures are stored, never checked), the ordered exchange's median time and bytes
    per step, and the two engines' parameters after training, equal to rounding. Two further launches run ``ordered``
    alone with deterministic algorithms on, the first with rank 1 slowed at random microbatches, the second rank 0:
    their parameters must be bitwise identical (the SHA-256 of every shard on every rank) and differ from the start.
    On a GPU the transport is the engine's ``auto`` (``cuda``); on CPU the ``cuda`` transport's protocol over shared
    memory (`CpuSegmentsCudaTransport`).
    """
    sizes = ORDERED[device]
    transport = "auto" if device == "cuda" else "cuda-on-cpu"
    env = {OVERLAP_ENV: "1"}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # the atomic reduction's accumulate kernel, interpreted on CPU tensors
    base = dict(device=device, transport=transport, cfg=sizes["cfg"], lengths=sizes["lengths"], steps=sizes["steps"])
    timed = launch(ordered_worker, 2, {**base, "reductions": ["atomic", "ordered"]}, timeout=300, env=env)
    # cuBLAS needs a fixed workspace to be deterministic (the variable is read when a process first uses cuBLAS)
    det_env = dict(env, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    runs = [
        launch(
            ordered_worker,
            2,
            {**base, "reductions": ["ordered"], "deterministic": True, "slow_rank": slow, "seed": slow},
            timeout=300,
            env=det_env,
        )
        for slow in (1, 0)
    ]

    def median_over_ranks(reduction: str, key: str) -> float:
        # a step's time is its slowest rank's (every rank leaves the closing barrier together); the warm-up dropped
        per_step = [max(values) for values in zip(*(r[reduction][key] for r in timed), strict=True)][1:]
        return statistics.median(per_step)

    step_s = {r: median_over_ranks(r, "step_s") for r in ("atomic", "ordered")}
    exchange = [max(v) for v in zip(*(r["ordered"]["exchange_s"] for r in timed), strict=True)][1:]
    out: dict[str, Any] = {
        "transport": timed[0]["ordered"]["transport"],
        "reductions_run": {r: timed[0][r]["reduction"] for r in ("atomic", "ordered")},
        "plan_microbatches_per_rank": [len(mbs) for mbs in sizes["lengths"]],
        "steps_timed": sizes["steps"] - 1,
        "step_s_median": step_s,
        "step_s_per_step": {r: [[x[r]["step_s"][i] for x in timed] for i in range(sizes["steps"])] for r in step_s},
        "ordered_over_atomic": step_s["ordered"] / step_s["atomic"],
        "exchange_s_median": statistics.median(exchange),
        "exchange_share_of_ordered_step": statistics.median(exchange) / step_s["ordered"],
        "bytes_read_per_step": {r: [x[r]["bytes_read"][-1] for x in timed] for r in step_s},
        "ordered_vs_atomic_params": _compare([r["ordered"]["params"] for r in timed], _gathered(timed, "atomic"), 2),
        "deterministic_runs": [run[0]["deterministic"] for run in runs],
        "hashes": [[r["ordered"]["hashes"] for r in run] for run in runs],
    }
    out["figures"] = {
        "atomic step s (median)": f"{step_s['atomic']:.4f}",
        "ordered step s (median)": f"{step_s['ordered']:.4f}",
        "ordered / atomic": f"{out['ordered_over_atomic']:.3f}",
        "ordered exchange s (median)": f"{out['exchange_s_median']:.4f}",
    }
    first, second = runs
    out["checks"] = {
        "both reductions ran as asked": out["reductions_run"] == {"atomic": "atomic", "ordered": "ordered"},
        "ordered and atomic parameters equal to rounding after training (max abs < 1e-4)": (
            out["ordered_vs_atomic_params"]["max_abs"] < 1e-4
        ),
        "ordered: the step-boundary exchange was timed and read the peer's contributions": all(x > 0 for x in exchange)
        and all(r["ordered"]["bytes_read"][-1] > r["atomic"]["bytes_read"][-1] for r in timed),
        "two ordered runs (deterministic algorithms, a different rank slowed): bitwise-identical parameters, "
        "SHA-256 of every shard on both ranks": all(
            a["ordered"]["hashes"] == b["ordered"]["hashes"] for a, b in zip(first, second, strict=True)
        ),
        "the ordered runs moved every parameter shard": all(
            r["ordered"]["hashes"][n] != r["ordered"]["initial"][n]
            for run in runs
            for r in run
            for n, shard in r["ordered"]["params"].items()
            if shard.size
        ),
    }
    return out


def _gathered(ranks: list[dict[str, Any]], reduction: str) -> dict[str, np.ndarray]:
    """The full parameters of ``reduction``'s model from every rank's shard (dim-0 shards, in rank order)."""
    names = ranks[0][reduction]["params"]
    return {n: np.concatenate([r[reduction]["params"][n] for r in ranks], axis=0) for n in names}


def case_refusals() -> dict[str, Any]:
    base = dict(cfg=SMALL, transports=["cuda", "auto"])
    shared = launch(refusal_worker, 2, base, timeout=300, env={OVERLAP_ENV: None})
    backend = launch(refusal_worker, 2, base, timeout=300, env={OVERLAP_ENV: "1", "TORCH_SYMMMEM": "NCCL"})
    # The medium model needs ~270 MiB per rank for its transport; the GPU is filled to leave 128 MiB free.
    memory = launch(
        refusal_worker,
        2,
        {"cfg": MEDIUM, "leave_free_mib": 128, "transports": ["cuda"]},
        timeout=300,
        env={OVERLAP_ENV: "1"},
    )
    checks = {
        "shared GPU without override refused on both ranks, naming the override": all(
            OVERLAP_ENV in r[n] for r in shared for n in ("cuda", "auto")
        ),
        "'auto' says it found no usable transport": all("'auto' found no usable" in r["auto"] for r in shared),
        "NCCL backend refused on both ranks": all("NCCL backend" in r[n] for r in backend for n in ("cuda", "auto")),
        "too little free memory refused, saying how much is needed": all(
            "need(s)" in r["cuda"] and "MiB is free" in r["cuda"] for r in memory
        ),
    }
    return {"shared_gpu": shared, "backend": backend, "memory": memory, "checks": checks}


def case_memory() -> dict[str, Any]:
    ranks = launch(memory_worker, 2, {"cfg": MEDIUM, "cycles": 2}, timeout=300, env={OVERLAP_ENV: "1"})
    mib = 2**20
    # The ranks share the GPU: free memory falls by both ranks' transports, so compare per rank (half of it).
    cycles = []
    for first, second in zip(ranks[0]["cycles"], ranks[1]["cycles"], strict=True):
        lost = (first["before"]["free"] - first["with_engine"]["free"]) / 2
        given_back = (first["after_close"]["free"] - first["with_engine"]["free"]) / 2
        reported = (first["report"]["total"] + second["report"]["total"]) / 2
        cycles.append({"lost_per_rank": lost, "given_back_per_rank": given_back, "reported_per_rank": reported})
    one, two = cycles[0], cycles[-1]
    return {
        "ranks": ranks,
        "cycles": cycles,
        # What the first engine of a process takes beyond its report and never gives back: CUDA context growth
        # (first-use kernels) and torch's symmetric-memory peer tables (CUDAPeerAllocInfo has no destructor).
        "uncounted_first_engine_per_rank": one["lost_per_rank"] - one["reported_per_rank"],
        "checks": {
            "second engine: what the GPU loses per rank equals the report (within 8 MiB)": abs(
                two["lost_per_rank"] - two["reported_per_rank"]
            )
            <= 8 * mib,
            "second engine: close() gives back everything it took (within 4 MiB)": abs(
                two["given_back_per_rank"] - two["lost_per_rank"]
            )
            <= 4 * mib,
            "first engine: close() gives back at least the report (within 4 MiB)": one["given_back_per_rank"]
            >= one["reported_per_rank"] - 4 * mib,
        },
    }


def case_memory_policy() -> dict[str, Any]:
    from tests.helpers.workers.memory_workers import neither_bound, peak_memory

    plan = [[[256, 128], [192]], [[160], [256, 64]], [[256], [256]]]
    spec = dict(plan=plan, cfg=MEDIUM, policies=["neither", "both"], device="cuda")
    ranks = launch(peak_memory, 2, spec, timeout=300, env={OVERLAP_ENV: "1"})
    sizes = neither_bound(ranks[0]["groups"], MEDIUM, 256, 2)
    staging = max(r["neither"]["transport"].get("staging", 0) for r in ranks)
    bound = sizes["total"] + staging
    neither = [max(r["neither"]["peaks"][1:]) for r in ranks]  # from step 2 on: .grad and AdamW's state exist
    both = [max(r["both"]["peaks"][1:]) for r in ranks]
    return {
        "bound": dict(sizes, staging=staging, bound=bound),
        "peak_neither": neither,
        "peak_both": both,
        "peak_neither_over_bound": [p / bound for p in neither],
        "summaries": {policy: ranks[0][policy]["summary"] for policy in spec["policies"]},
        "checks": {
            "neither: allocator peak within 1.05 x the bound": all(p <= 1.05 * bound for p in neither),
            "both keeps more than neither": all(b > n for b, n in zip(both, neither, strict=True)),
        },
    }


def case_speed() -> dict[str, Any]:
    """The transport's read and accumulate between the two ranks, and the accumulate paths at 1 GiB of source, each
    rank alone, at the default grid caps (the sweep over sizes and grids, and the engine step with each path, are
    stored with the H100 runs in ``benchmarks/gpu/``)."""
    from .accumulate_bench import measure

    ranks = launch(speed_worker, 2, {"numel": 64 * 2**20, "iters": 10}, timeout=300, env={OVERLAP_ENV: "1"})
    paths = measure("cuda", sizes_mib=[1024], sm_shares=[0.25, 0.5])  # every accumulate path, each rank alone
    return {
        "transport": ranks,
        "accumulate_paths": paths,
        "checks": {
            "accumulate sums exactly (fp32)": all(r["accumulate_ok"] for r in ranks),
            "read returns the peer's shard": all(r["read_ok"] for r in ranks),
            **paths["checks"],
        },
    }


def environment() -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_memory=props.total_memory, device_count=torch.cuda.device_count())
        from odc_accelerate.transport.cuda import local_device_facts

        out["facts"] = dataclasses.asdict(local_device_facts(torch.device("cuda", 0)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json and summary.txt")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--cases", default=None, help=f"comma-separated subset of {','.join(CASES)}")
    args = p.parse_args(argv)
    available = CASES if args.device == "cuda" else CPU_CASES
    cases = args.cases.split(",") if args.cases else list(available)
    unknown = [c for c in cases if c not in available]
    if unknown:
        p.error(f"case(s) {unknown} do not run on {args.device}; choose from {', '.join(available)}")
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, Any] = {"environment": environment()}
    runners = {
        "refusals": case_refusals,
        "parity": lambda: case_parity(args.device),
        "ranks8": lambda: case_ranks8(args.device),
        "memory": case_memory,
        "ordered": lambda: case_ordered(args.device),
        "memory_policy": case_memory_policy,
        "speed": case_speed,
    }
    for name in cases:
        start = time.perf_counter()
        try:
            results[name] = runners[name]()
        except Exception:
            results[name] = {"error": traceback.format_exc(), "checks": {"ran": False}}
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
        _write(args.out, results)
    failed = [f"{case}: {check}" for case in cases for check, ok in results[case]["checks"].items() if not ok]
    with open(os.path.join(args.out, "summary.txt")) as f:
        sys.stdout.write(f.read())
    return 1 if failed else 0


def _write(out: str, results: dict[str, Any]) -> None:
    def plain(x: Any) -> Any:
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in x.items() if k not in ("grads", "params")}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, (np.floating, np.integer)):
            return x.item()
        if isinstance(x, (str, int, float, bool)) or x is None:
            return x
        return str(x)

    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(plain(results), f, indent=1)
    lines = [f"torch {torch.__version__}, CUDA {torch.version.cuda}, {results['environment'].get('gpu', 'no GPU')}"]
    for case, res in results.items():
        if case == "environment":
            continue
        lines.append(f"[{case}] {res.get('seconds', '?')} s")
        for check, ok in res.get("checks", {}).items():
            lines.append(f"  {'PASS' if ok else 'FAIL'}  {check}")
        for figure, value in res.get("figures", {}).items():  # measured, stored, never checked
            lines.append(f"  ----  {figure}: {value}")
        if "error" in res:
            lines.append("  " + res["error"].strip().splitlines()[-1])
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    # Run through the package (`from tests.gpu.gpu_check import main`) so that the spawned ranks import
    # the workers from this module's real name; scripts/gpu_check.sh does.
    sys.exit(main())
