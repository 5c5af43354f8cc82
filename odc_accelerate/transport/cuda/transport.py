"""CUDA transport for the GPUs of one node: torch symmetric memory for data, shared memory for control.

Data plane: one symmetric-memory segment per rank (published shards and accumulators, nothing per peer); ``read`` is a
copy on the caller's stream, ``accumulate`` an atomic add into the owner's accumulator (the :mod:`.kernels` kernel, or
``index_add_`` through a staging pool where Triton cannot run on some rank). Control plane: a small ``ShmTransport``
(barrier, dead-peer detection, ``claim``) and a :mod:`.watchdog` over the set-up steps that have no timeout. The ranks
exchange device facts and refuse together before allocating. Design, memory, refusals and what ran on a GPU:
docs/transports.md ("`cuda`") and docs/gpu.md.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ... import memory_spec
from ...reduction import ReductionName
from ..base import BufferSpec, Transport, is_out_of_memory
from ..shm import ShmTransport
from . import watchdog
from .device import (
    KERNEL_PATH,
    choose_accumulate_path,
    gather_device_facts,
    local_accumulate_kernel,
    local_device_facts,
)
from .kernels import accumulate_, max_programs
from .segments import (
    SETUP_MARGIN_BYTES,
    DeviceFacts,
    SegmentPlan,
    StagingPool,
    choose_reduction,
    device_refusal,
    memory_refusal,
    plan_segment,
    staging_bytes_setting,
    transport_memory_text,
)

logger = logging.getLogger(__name__)

_PHASE = "setup_phase"  # control plane: how far this rank got in set-up (`.watchdog`)
_FREE = "setup_free"  # control plane: this rank's free GPU bytes when its allocation ran out of memory


class CudaTransport(Transport):
    """One-sided reads and atomic accumulates between the GPUs of one node through torch symmetric memory.

    Engine parity on one H100 once; not yet on several GPUs (see the module docstring and ``docs/gpu.md``).

    Args:
        rank (`int`): this rank.
        world_size (`int`): number of ranks (all on this node).
        timeout (`float`, *optional*, defaults to 600.0): seconds a barrier may wait.
        group (`torch.distributed.ProcessGroup`, *optional*): the ODC group, used inside ``register`` only.
        device (`torch.device`, *optional*): this rank's GPU; defaults to the current CUDA device.
        staging_mib (`float`, *optional*): size of the staging pool in MiB; defaults to ``$ODC_CUDA_STAGING_MIB``, else
            64. Larger pools mean fewer, longer add kernels; any size is correct.
        accumulate_dtype (`torch.dtype`, *optional*): dtype of the gradient accumulators. By default 16-bit reduce
            dtypes are widened to fp32 (a whole step is summed before the fold); pass e.g. ``torch.bfloat16`` to keep
            them narrow and save memory.
        accumulate_sm_share (`float`, *optional*): share of the GPU's SMs the accumulate kernel's grid may cover; the
            rest are left to the backward pass it runs beside. Defaults to `.kernels.default_sm_share` of each
            gradient's dtype: a quarter of the SMs for fp32 gradients, half for bf16 and fp16 ones.
        accumulate_kernel (`bool`, *optional*, defaults to `True`): add with the accumulate kernel where it compiles
            and runs on every rank; `False` keeps the ``index_add_`` fallback (to compare the two, or to step around a
            kernel problem).

    Buffers registered with ``accumulated=True`` come back in the accumulator dtype, which may be wider than
    registered; the engine's fold divides in that dtype and then casts to the parameters' dtype.
    """

    name = "cuda"
    devices = ("cuda",)
    # Native peer-to-peer atomics over NVLink, none over PCIe: `choose_reduction` asks every rank's GPU.
    adds_atomically = False

    @classmethod
    def create(
        cls,
        rank: int,
        world_size: int,
        *,
        timeout: float,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
    ) -> CudaTransport:
        return cls(rank, world_size, timeout=timeout, group=group, device=device)

    @classmethod
    def auto_refusal(
        cls, *, group: dist.ProcessGroup | None, world_size: int, device: torch.device, atomics: bool
    ) -> str | None:
        """Collective: the device checks (`.segments.device_refusal`) on every rank's gathered facts, so that all ranks
        choose or refuse together. ``atomics=False`` accepts GPUs that can read but not add into each other's memory."""
        return device_refusal(gather_device_facts(group, world_size, device), atomics=atomics)

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout: float = 600.0,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        *,
        staging_mib: float | None = None,
        accumulate_dtype: torch.dtype | None = None,
        accumulate_sm_share: float | None = None,
        accumulate_kernel: bool = True,
    ) -> None:
        super().__init__(rank, world_size, timeout)
        if accumulate_sm_share is not None and not 0 < accumulate_sm_share <= 1:
            raise ValueError(f"accumulate_sm_share must be in (0, 1], got {accumulate_sm_share}")
        self._sm_share = accumulate_sm_share
        self._use_kernel = accumulate_kernel
        # The accumulate kernel's grid cap, set by `register` from ``accumulate_sm_share``; None: the kernel's default
        # for each gradient's dtype.
        self._programs: int | None = None
        #: how gradients are added (`.device.KERNEL_PATH` or `.device.FALLBACK_PATH`; None before ``register`` or
        #: without accumulators), and why that path
        self.accumulate_path: str | None = None
        self.accumulate_reason = ""
        self._group = group
        self._device = torch.device(device) if device is not None else None
        self._staging_bytes = staging_bytes_setting(staging_mib)
        self._accumulate_dtype = accumulate_dtype
        self._control: ShmTransport | None = None
        self._phase: torch.Tensor | None = None
        self._plan: SegmentPlan | None = None
        self._pool: StagingPool | None = None
        self._handle = None
        self._segment: torch.Tensor | None = None
        self._views: list[dict[str, torch.Tensor]] = []
        self._closed = False
        # Streams this rank enqueued transport work on since the last flush. `flush` waits for these only: a
        # device-wide synchronize would also wait for queued NCCL kernels, which hangs if a peer enqueues the matching
        # collective only after the ODC barrier.
        self._streams: set[torch.cuda.Stream] = set()
        #: seconds spent in `flush` (this rank's own queued GPU work), summed since construction
        self.flush_s = 0.0

    @property
    def job_id(self) -> str | None:
        return self._control.job_id if self._control is not None else None

    @property
    def plan(self) -> SegmentPlan | None:
        """The segment's layout and memory budget (None before ``register``)."""
        return self._plan

    def memory_report(self) -> dict[str, int]:
        """Bytes of GPU memory this transport holds: ``published``, ``accumulator``, ``staging``, ``total``."""
        if self._plan is None or self._closed:
            return {}
        return self._plan.report()

    def register(self, specs: Mapping[str, BufferSpec]) -> dict[str, torch.Tensor]:
        if self._plan is not None:
            raise RuntimeError("CudaTransport.register may be called only once")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("CudaTransport.register needs an initialised torch.distributed process group")
        device = self._resolved_device()
        # Every check below is made on every rank from the same gathered facts, so all ranks refuse together before
        # any of them enters the symmetric-memory rendezvous (which has no timeout and raises inside C++). The facts
        # carry whether the accumulate kernel compiled and ran here, so that all ranks take the same accumulate path.
        accumulated = [spec for spec in specs.values() if spec.accumulated]
        kernel = local_accumulate_kernel(device, accumulated, self._accumulate_dtype, self._use_kernel)
        facts = self._gather_facts(device, kernel)
        # Peers add into each other's memory only where something is accumulated (the atomic reduction); the ordered
        # reduction and a frozen engine only read it.
        reason = device_refusal(facts, atomics=bool(accumulated))
        if reason:
            raise RuntimeError(f"the 'cuda' ODC transport cannot run: {reason}")
        from ..._compat.torch import symm_mem as compat

        pad = compat.symmetric_signal_pad_bytes()
        plan = plan_segment(specs, self._staging_bytes, self._accumulate_dtype, signal_pad_bytes=pad, staged=False)
        if plan.accumulated:
            self.accumulate_path, self.accumulate_reason = choose_accumulate_path(facts)
            if self.accumulate_path == KERNEL_PATH:
                self._programs = max_programs(device, self._sm_share) if self._sm_share is not None else None
            else:  # the fallback adds through the staging pool: plan it
                plan = plan_segment(specs, self._staging_bytes, self._accumulate_dtype, signal_pad_bytes=pad)
        reason = memory_refusal(plan, facts)
        if reason:
            raise RuntimeError(f"the 'cuda' ODC transport cannot run: {reason}")
        self._plan = plan
        # Control plane first: it also checks that every rank is on this host (CUDA IPC cannot cross hosts).
        self._control = ShmTransport(self.rank, self.world_size, timeout=self.timeout, group=self._group)
        control = self._control.register(
            {_PHASE: BufferSpec(numel=1, dtype=torch.int64), _FREE: BufferSpec(numel=1, dtype=torch.int64)}
        )
        self._phase, self._free_slot = control[_PHASE], control[_FREE]
        try:
            segments = self._map_segments(plan, device)
            self._segment = segments[self.rank]
            self._views = [{name: plan.view(seg, name) for name in plan.offsets} for seg in segments]
            self._sync()  # zeroed before any peer can add
            self._control.barrier()
        except BaseException:
            if self._phase is not None and int(self._phase) != watchdog.OUT_OF_MEMORY:  # peers read that one
                self._set_phase(watchdog.FAILED)  # the peers' watchdogs stop waiting for this rank
            self.close()
            raise
        logger.info(
            "cuda transport up: rank %d/%d on %s; ODC GPU memory per rank %s; accumulate path %s",
            self.rank,
            self.world_size,
            device,
            plan.describe(),
            self.accumulate_path or "none (nothing is accumulated)",
        )
        return dict(self._views[self.rank])

    def choose_reduction(self, requested: ReductionName) -> tuple[ReductionName, str]:
        """Collective under ``auto``: the gradient reduction to run over these GPUs, and why
        (`.segments.choose_reduction`).

        An explicit ``requested`` is kept. ``auto`` is ``atomic`` unless some pair of GPUs cannot add into each other's
        memory natively (PCIe rather than NVLink) or deterministic algorithms are on: then ``ordered``, which only
        reads peers' memory, instead of refusing. The ranks decide from every rank's gathered device facts, so all
        choose alike.
        """
        if requested != ReductionName.AUTO:
            return choose_reduction(requested, [])
        facts = self._gather_facts(self._resolved_device(), (False, "not checked before the reduction is chosen"))
        return choose_reduction(ReductionName.AUTO, facts)

    def _resolved_device(self) -> torch.device:
        device = self._device or torch.device("cuda")
        if device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def _local_facts(self, device: torch.device, kernel: tuple[bool, str]) -> DeviceFacts:
        """This rank's device facts, with ``kernel``: whether it can add with the accumulate kernel, and why (not)."""
        settings = (self._staging_bytes, str(self._accumulate_dtype))
        facts = local_device_facts(device, settings)
        return dataclasses.replace(facts, accumulate_kernel=kernel[0], accumulate_kernel_reason=kernel[1])

    def _gather_facts(self, device: torch.device, kernel: tuple[bool, str]) -> list[DeviceFacts]:
        """Collective: every rank's device facts (the checks run on them before anything is allocated)."""
        local = self._local_facts(device, kernel)
        return gather_device_facts(self._group, self.world_size, device, local=local)

    def _set_phase(self, phase: int) -> None:
        if self._phase is not None:
            self._phase.fill_(phase)

    def _phase_of(self, rank: int) -> int:
        out = torch.empty(1, dtype=torch.int64)
        self._control.read(rank, _PHASE, out)
        return int(out)

    def _map_segments(self, plan: SegmentPlan, device: torch.device) -> list[torch.Tensor]:
        """Collective: allocate this rank's zeroed segment (and staging pool) and map every peer's; element ``r`` is
        rank ``r``'s.

        Every rank allocates, then the ranks agree on the host that all of them succeeded before any enters the
        rendezvous: a rank out of GPU memory makes every rank raise the same refusal, instead of leaving its peers
        blocked in a call with no timeout. Symmetric memory's calls have none, so a watchdog guards each of them: it
        ends this process, naming the rank at fault, if a peer fails or dies there or nothing finishes in time.
        """
        self._set_phase(watchdog.ALLOCATING)
        own = None
        with self._watchdog():
            try:
                own = self._allocate_segment(plan.segment_bytes, device)
                if plan.staging_bytes:
                    self._pool = StagingPool(plan.chunk_numel, plan.cast_dtype, device, cast=plan.needs_cast)
            except Exception as err:
                if not is_out_of_memory(err):
                    raise
                own = self._pool = None
                self._report_out_of_memory(device)
        if own is not None:
            self._set_phase(watchdog.ALLOCATED)
        self._agree_on_allocation(plan)
        self._set_phase(watchdog.RENDEZVOUS)
        with self._watchdog():
            segments = self._exchange_segments(own, plan.segment_bytes)
        self._set_phase(watchdog.MAPPED)
        return segments

    def _watchdog(self) -> watchdog.SetupWatchdog:
        return watchdog.SetupWatchdog(
            self.rank, self.world_size, self.timeout, self._phase_of, self._control.dead_peers
        )

    def _free_bytes(self, device: torch.device) -> int:
        """Free memory on this rank's GPU now, after releasing torch's cache (what a refusal names)."""
        return memory_spec.free_and_total(device, release_cache=True)[0]

    def _report_out_of_memory(self, device: torch.device) -> None:
        """Tell the peers (control plane) that this rank's allocation ran out of memory, and how much was free."""
        self._free_slot.fill_(self._free_bytes(device))
        self._set_phase(watchdog.OUT_OF_MEMORY)

    def _agree_on_allocation(self, plan: SegmentPlan) -> None:
        """Wait on the host until every rank allocated, or raise the same refusal on every rank if one ran out of
        memory. A peer that failed otherwise or died, or a wait beyond the timeout, raises too (this rank is not in
        a blocking call yet, so it can)."""
        deadline = time.monotonic() + self.timeout
        while True:
            phases = [self._phase_of(r) for r in range(self.world_size)]
            short = [r for r, p in enumerate(phases) if p == watchdog.OUT_OF_MEMORY]
            if short:
                free = {r: self._free_of(r) for r in short}
                who = f"rank {short[0]}" if len(short) == 1 else f"ranks {short}"
                need = (plan.device_bytes + SETUP_MARGIN_BYTES) * len(short)
                ran_out = "its allocation ran out of GPU memory"
                text = transport_memory_text(who, need, min(free.values()), plan, SETUP_MARGIN_BYTES, ran_out=ran_out)
                raise RuntimeError(f"the 'cuda' ODC transport cannot run: {text}")
            if all(p >= watchdog.ALLOCATED for p in phases):
                return
            failed = [r for r, p in enumerate(phases) if p == watchdog.FAILED]
            dead = self._control.dead_peers()
            if failed or dead:
                raise RuntimeError(
                    f"the 'cuda' ODC transport's set-up stopped on rank {self.rank}: rank(s) {sorted({*failed, *dead})} "
                    "failed or exited during set-up (see their own error)"
                )
            if time.monotonic() >= deadline:
                behind = [r for r, p in enumerate(phases) if p < watchdog.ALLOCATED]
                raise RuntimeError(
                    f"the 'cuda' ODC transport's set-up on rank {self.rank} timed out after {self.timeout:g}s waiting "
                    f"for rank(s) {behind} to allocate their segments"
                )
            time.sleep(0.005)

    def _free_of(self, rank: int) -> int:
        out = torch.empty(1, dtype=torch.int64)
        self._control.read(rank, _FREE, out)
        return int(out)

    def _allocate_segment(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """Collective (every rank of the group calls it): this rank's zeroed segment in symmetric memory."""
        from ..._compat.torch import symm_mem as compat

        own = compat.symmetric_segment(nbytes, device, self._group or dist.group.WORLD)
        own.zero_()
        return own

    def _exchange_segments(self, own: torch.Tensor, nbytes: int) -> list[torch.Tensor]:
        """Collective: the rendezvous; every rank's segment mapped into this process, indexed by rank."""
        from ..._compat.torch import symm_mem as compat

        self._handle = compat.symmetric_rendezvous(own, self._group or dist.group.WORLD)
        return [
            own if peer == self.rank else compat.peer_segment(self._handle, peer, nbytes)
            for peer in range(self.world_size)
        ]

    def _note_stream(self) -> None:
        """Remember the caller's current stream: transport work is enqueued there, and `flush` waits for it."""
        if self._segment is not None and self._segment.device.type == "cuda":
            self._streams.add(torch.cuda.current_stream(self._segment.device))

    def _sync(self) -> None:
        """Wait for this rank's own queued work: the streams it used (and the current one, where publishes are
        written), never the whole device."""
        if self._segment is None or self._segment.device.type != "cuda":
            return
        self._note_stream()
        streams, self._streams = self._streams, set()
        for stream in streams:
            stream.synchronize()

    def read(self, peer: int, name: str, out: torch.Tensor) -> None:
        self._note_stream()
        out.copy_(self._views[peer][name].view(out.shape), non_blocking=True)

    def accumulate(self, owner: int, name: str, src: torch.Tensor) -> None:
        if name not in self._plan.accumulated:
            raise KeyError(f"buffer {name!r} was not registered with accumulated=True: nothing may add into it")
        self._note_stream()
        if self._pool is None:
            # The kernel reads src in place: contiguous already (a row of FSDP2's reduce-scatter input).
            accumulate_(self._views[owner][name], src.contiguous(), programs=self._programs)
        else:
            self._pool.add(self._views[owner][name], src)

    def flush(self) -> None:
        """Wait until every add, read and publish this rank enqueued has completed on its GPU.

        Waits on the streams that `read` and `accumulate` were called on, and on the current stream (publishes are
        written there), not on the whole device: queued NCCL kernels of other process groups are not waited for."""
        if self._segment is None:
            return  # not registered, or closed: nothing of ours is in flight
        start = time.perf_counter()
        self._sync()
        self.flush_s += time.perf_counter() - start

    has_claims = True

    def claim(self, round: int) -> int:
        """The control plane's claim (`ShmTransport.claim`): the ranks share a host, and a claim is host-side work."""
        return self._control.claim(round)

    def barrier(self) -> None:
        # This rank's adds must have landed in the owners' memory, and its reads of peers' shards finished, before the
        # peers hear that it arrived.
        self.flush()
        self._control.barrier()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._segment is not None:
            try:
                self._sync()  # nothing in flight reads the memory being released
            except RuntimeError as err:  # pragma: no cover - a broken device: release what we can
                logger.warning("cuda transport close: device synchronize failed: %s", err)
        # The segment is freed when its last view dies: ours, the peers' mappings and the handle go here; the caller
        # must drop the buffers `register` returned (the engine does at close).
        self._views = []
        self._pool = None
        self._handle = None
        self._segment = None
        if self._control is not None:
            self._control.close()
            self._phase = None
