"""What the engine-level GPU cases share: the toy LM's sizes, the transports they run on, the training worker and the
one-process reference.

`CpuSegmentsCudaTransport` is the 'cuda' transport's protocol (segment plan, fp32 accumulators, chunked adds through
the staging pool, the claim counter) over shared memory instead of GPU symmetric memory: the ``--device cpu`` dry run
and the CPU tests run the transport's logic through it.
"""

from __future__ import annotations

import copy
import dataclasses
import fcntl
import time
from typing import Any

import numpy as np
import torch

from odc_accelerate.testing.models import ToyConfig, build_model, make_steps, shard_model, token_loss_sum
from odc_accelerate.transport import BufferSpec, CudaTransport, ShmTransport
from odc_accelerate.transport.cuda import DeviceFacts

OVERLAP_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"


SMALL = dict(vocab=128, dim=64, heads=4, layers=3)


MEDIUM = dict(vocab=8192, dim=1024, heads=16, layers=4)


# rank 0 runs 1 microbatch per step, rank 1 runs 4
PLAN = [[[12], [9, 15, 7, 11]], [[16], [5, 13, 10, 8]], [[6], [14, 9, 12, 10]]]


def rank_device(kind: str) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU
        return torch.device("cuda", 0)
    return torch.device("cpu")


def precision_policy(precision: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    if precision == "bf16-fp32-reduce":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def math_sdpa():
    """Deterministic attention kernels on both sides of a parity comparison."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def local_array(t: torch.Tensor) -> np.ndarray:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().float().cpu().numpy().copy()


def make_transport(spec: dict[str, Any], rank: int, world_size: int, device: torch.device):
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


def train_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train the toy LM with ODC for ``spec["plan"]``; return this rank's gradient and parameter shards.

    With ``spec["dynamic"]`` the step's microbatches (every rank's, in plan order: the same list on every rank) form
    one queue that the ranks claim from while the step runs (``engine.claim_microbatches``, the ``dynamic`` plan);
    ``claimed`` lists the indices this rank ran in each step.
    """
    from odc_accelerate.engine import ODCEngine
    from odc_accelerate.loss import loss_scale

    device = rank_device(spec["device"])
    cfg = ToyConfig(**spec["cfg"])
    model = shard_model(build_model(cfg, seed=0).to(device), mp_policy=precision_policy(spec["precision"]))
    engine = ODCEngine(model, transport=make_transport(spec, rank, world_size, device), timeout=120.0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    first_grads: dict[str, np.ndarray] = {}
    step_s, claimed = [], []
    with math_sdpa():
        for index, step in enumerate(make_steps(spec["plan"], cfg.vocab, seed=1)):
            sync_device(device)
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
                first_grads = {n: local_array(p.grad) for n, p in model.named_parameters() if p.grad is not None}
            optim.step()
            optim.zero_grad()
            engine.post_optimizer_step()
            sync_device(device)
            step_s.append(time.perf_counter() - start)
    stats = engine.last_step_stats
    out = {
        "grads": first_grads,
        "params": {n: local_array(p) for n, p in model.named_parameters()},
        "transport": engine.transport.name,
        "accumulate_path": getattr(engine.transport, "accumulate_path", None),
        "memory_report": engine.transport.memory_report(),
        "stats": dataclasses.asdict(stats) if stats is not None else None,
        "step_s": step_s,
        "claimed": claimed,
    }
    engine.close()
    return out


def reference(spec: dict[str, Any]) -> dict[str, Any]:
    """One process runs every rank's microbatches: first-step gradients and parameters after every step.

    With a bf16 policy the microbatches run on a bf16 copy of the model (what FSDP2's mixed precision computes with)
    and their bf16 gradients are summed in fp64, so the comparison isolates how ODC accumulates.
    """
    device = rank_device(spec["device"])
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the ranks run: CPU kernels block their sums by thread count
    cfg = ToyConfig(**spec["cfg"])
    world = len(spec["plan"][0])
    model = build_model(cfg, seed=0).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    first_grads = {}
    with math_sdpa():
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


def compare_to_reference(
    ranks: list[dict[str, np.ndarray]], ref: dict[str, np.ndarray], world: int
) -> dict[str, float]:
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
