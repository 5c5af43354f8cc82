"""Host-side segment plan of the CUDA transport: sizing, refusals and chunked atomic adds, independent of any GPU.

Everything here takes device facts as data (:class:`DeviceFacts`, gathered from every rank) or runs on any torch
device, so the unit tests exercise it on CPU; :mod:`.device` supplies the GPU facts, :mod:`.transport` the
symmetric-memory segment and the streams. The two add paths (the Triton kernel, or ``index_add_`` through a staging
pool of fixed size) and the memory they take: docs/transports.md, "`cuda`".
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ... import memory_spec
from ...reduction import ReductionName
from ..base import BufferSpec

#: byte alignment of every buffer in a segment (wide vector loads, any dtype's storage offset). A multiple of 16: the
#: accumulate kernel's 16-byte vector reductions need every accumulator view 16-byte aligned (the segment's base is).
ALIGN = 256
#: symmetric-memory blocks are mapped in units of this size (the CUDA VMM granularity on current GPUs)
SEGMENT_GRANULARITY = 2 * 2**20
#: staging pool size when neither the constructor nor the environment sets one
DEFAULT_STAGING_MIB = 64
#: the largest pool the default may reach; a user may ask for more explicitly
MAX_DEFAULT_STAGING_MIB = 256
#: environment variable that sets the staging pool size in MiB
STAGING_ENV = "ODC_CUDA_STAGING_MIB"
#: torch's switch that lets several ranks share one GPU (read by symmetric memory's rendezvous)
OVERLAP_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"
#: torch's symmetric-memory backend selector
BACKEND_ENV = "TORCH_SYMMMEM"
#: index entries are int32: the pool never holds a chunk this long
_MAX_CHUNK = 2**31 - 1
_INDEX_DTYPE = torch.int32


def _aligned(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALIGN) * ALIGN


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def staging_bytes_setting(staging_mib: float | None = None) -> int:
    """The staging pool size in bytes: ``staging_mib`` if given, else ``$ODC_CUDA_STAGING_MIB``, else 64 MiB.

    Raises:
        ValueError: the setting is not a positive number of MiB (names where it came from).
    """
    source = "staging_mib"
    if staging_mib is None:
        raw = os.environ.get(STAGING_ENV)
        if raw is None:
            return DEFAULT_STAGING_MIB * 2**20
        source = f"${STAGING_ENV}"
        try:
            staging_mib = float(raw)
        except ValueError:
            raise ValueError(f"{source} must be a number of MiB, got {raw!r}") from None
    if not staging_mib > 0:
        raise ValueError(f"{source} must be > 0 MiB, got {staging_mib}")
    return int(staging_mib * 2**20)


def accumulator_dtype(spec_dtype: torch.dtype, requested: torch.dtype | None = None) -> torch.dtype:
    """dtype of an accumulator registered as ``spec_dtype``: fp32 for 16-bit floats unless ``requested`` says less.

    A whole step of microbatches is summed in the accumulator before the fold; in bf16 that loses the low bits of every
    partial sum, so 16-bit reduce dtypes are widened to fp32 (the fold divides in fp32 and then casts to the
    parameters' dtype). ``requested`` (e.g. ``torch.bfloat16``) keeps a narrower accumulator on purpose.
    """
    if requested is not None:
        if not requested.is_floating_point:
            raise ValueError(f"accumulate_dtype must be a floating-point dtype, got {requested}")
        return requested
    if spec_dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return spec_dtype


@dataclass(frozen=True)
class SegmentPlan:
    """Byte layout of one rank's segment (identical on every rank) and the transport's whole memory budget.

    Attributes:
        offsets (`dict[str, int]`): byte offset of each buffer in the segment.
        dtypes (`dict[str, torch.dtype]`): dtype each buffer is stored in (accumulators may be wider than registered).
        numels (`dict[str, int]`): elements of each buffer.
        accumulated (`list[str]`): buffers peers add into.
        segment_bytes (`int`): bytes of the segment as laid out (before the allocator rounds it up).
        published_bytes (`int`): bytes of the buffers nobody adds into (published shards, flags).
        accumulator_bytes (`int`): bytes of the accumulators.
        staging_bytes (`int`): bytes of the staging pool (0 when nothing is accumulated, or the adds run the
            accumulate kernel, which stages nothing).
        chunk_numel (`int`): elements per atomic-add chunk, what the pool holds (0 without a pool).
        cast_dtype (`torch.dtype | None`): the accumulators' dtype (None without accumulators).
        needs_cast (`bool`): some accumulator is wider than its registered dtype, so the pool holds a cast chunk.
    """

    offsets: dict[str, int]
    dtypes: dict[str, torch.dtype]
    numels: dict[str, int]
    accumulated: list[str]
    segment_bytes: int
    published_bytes: int
    accumulator_bytes: int
    staging_bytes: int
    chunk_numel: int
    cast_dtype: torch.dtype | None = None
    needs_cast: bool = False
    signal_pad_bytes: int = SEGMENT_GRANULARITY

    @property
    def device_bytes(self) -> int:
        """What the transport allocates on its GPU: the segment and torch's signal pad (allocated with it), rounded up
        to the mapping granularity, plus the pool."""
        mapped = self.segment_bytes + self.signal_pad_bytes
        return -(-mapped // SEGMENT_GRANULARITY) * SEGMENT_GRANULARITY + self.staging_bytes

    def report(self) -> dict[str, int]:
        """The memory report (bytes): ``published``, ``accumulator``, ``staging``, ``total`` (allocated)."""
        return {
            "published": self.published_bytes,
            "accumulator": self.accumulator_bytes,
            "staging": self.staging_bytes,
            "total": self.device_bytes,
        }

    def describe(self) -> str:
        staging = f" + staging {_mib(self.staging_bytes)}" if self.staging_bytes else ""
        return (
            f"{_mib(self.device_bytes)} (published {_mib(self.published_bytes)} + accumulator "
            f"{_mib(self.accumulator_bytes)}{staging}, rounded to {_mib(SEGMENT_GRANULARITY)} mappings)"
        )

    def view(self, segment: torch.Tensor, name: str) -> torch.Tensor:
        """Buffer ``name`` inside ``segment`` (a 1-D uint8 tensor laid out by this plan)."""
        start = self.offsets[name]
        dtype = self.dtypes[name]
        return segment[start : start + self.numels[name] * dtype.itemsize].view(dtype)


def plan_segment(
    specs: Mapping[str, BufferSpec],
    staging_bytes: int,
    accumulate_dtype: torch.dtype | None = None,
    signal_pad_bytes: int | None = None,
    *,
    staged: bool = True,
) -> SegmentPlan:
    """Lay out the segment for ``specs`` and size the staging pool's chunks.

    Args:
        specs: the registered buffers, in registration order.
        staging_bytes: the pool's budget (see `staging_bytes_setting`).
        accumulate_dtype: dtype to store accumulated buffers in; None widens 16-bit floats to fp32.
        signal_pad_bytes: the signal pad torch's symmetric memory allocates with each segment; None (a torch that
            does not say) counts a whole mapping granule, an upper bound.
        staged: the adds go through the staging pool (the ``index_add_`` path); False for the accumulate kernel,
            which needs no pool (``staging_bytes`` is then ignored).

    Raises:
        ValueError: the pool cannot hold even one useful chunk, or accumulators disagree on their dtype.
    """
    offsets: dict[str, int] = {}
    dtypes: dict[str, torch.dtype] = {}
    numels: dict[str, int] = {}
    accumulated: list[str] = []
    offset = published = acc_bytes = 0
    cast_dtype = None
    needs_cast = False
    for name, spec in specs.items():
        dtype = accumulator_dtype(spec.dtype, accumulate_dtype) if spec.accumulated else spec.dtype
        offsets[name], dtypes[name], numels[name] = offset, dtype, spec.numel
        offset += _aligned(spec.numel * dtype.itemsize)
        if spec.accumulated:
            accumulated.append(name)
            acc_bytes += spec.numel * dtype.itemsize
            if cast_dtype is not None and cast_dtype != dtype:
                raise ValueError(f"accumulators use several dtypes ({cast_dtype} and {dtype}); register one")
            cast_dtype = dtype
            needs_cast = needs_cast or dtype != spec.dtype
        else:
            published += spec.numel * dtype.itemsize
    chunk = 0
    pool = 0
    if accumulated and staged:
        # Per chunk element: one int32 index, and one element of the accumulator's dtype where a narrower gradient is
        # cast before its add.
        per_element = _INDEX_DTYPE.itemsize + (cast_dtype.itemsize if needs_cast else 0)
        chunk = min(staging_bytes // per_element, _MAX_CHUNK)
        if chunk < 1024:
            raise ValueError(
                f"the staging pool of {staging_bytes} bytes cannot hold a chunk of 1024 elements "
                f"({1024 * per_element} bytes); raise staging_mib / ${STAGING_ENV}"
            )
        largest = max(specs[name].numel for name in accumulated)
        chunk = min(chunk, max(largest, 1024))  # no pool larger than the largest accumulator needs
        pool = chunk * per_element
    return SegmentPlan(
        offsets=offsets,
        dtypes=dtypes,
        numels=numels,
        accumulated=accumulated,
        segment_bytes=max(offset, ALIGN),
        published_bytes=published,
        accumulator_bytes=acc_bytes,
        staging_bytes=pool,
        chunk_numel=chunk,
        cast_dtype=cast_dtype,
        needs_cast=needs_cast,
        signal_pad_bytes=SEGMENT_GRANULARITY if signal_pad_bytes is None else int(signal_pad_bytes),
    )


def chunk_spans(numel: int, chunk: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive chunks of at most ``chunk`` elements covering ``range(numel)``."""
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0, got {chunk}")
    for start in range(0, numel, chunk):
        yield start, min(start + chunk, numel)


class StagingPool:
    """The ``index_add_`` fallback's bounded device memory: an index vector and one cast chunk (the accumulate
    kernel needs neither).

    ``index_add_`` on CUDA adds with ``atomicAdd``, so concurrent adds from several ranks into one accumulator are
    safe; it needs an index (``arange``) and a ``src`` of the accumulator's dtype. Both come from here, reused chunk
    after chunk on one stream; a call on another stream first waits for the previous user of the pool.

    Args:
        chunk_numel (`int`): elements per chunk.
        dtype (`torch.dtype`): the accumulators' dtype.
        device (`torch.device`): where the pool lives (CPU in tests).
        cast (`bool`, *optional*, defaults to `True`): hold a cast chunk (needed when gradients are narrower than the
            accumulators).
    """

    def __init__(self, chunk_numel: int, dtype: torch.dtype, device: torch.device, cast: bool = True) -> None:
        self.chunk_numel = chunk_numel
        self.dtype = dtype
        self.index = torch.arange(chunk_numel, dtype=_INDEX_DTYPE, device=device)
        self.cast = torch.empty(chunk_numel if cast else 0, dtype=dtype, device=device)
        self._cuda = torch.device(device).type == "cuda"
        self._last_stream = None
        self._last_use = None

    @property
    def nbytes(self) -> int:
        return self.index.nbytes + self.cast.nbytes

    def _enter(self) -> None:
        if not self._cuda:
            return
        stream = torch.cuda.current_stream(self.index.device)
        if self._last_use is not None and stream != self._last_stream:
            stream.wait_event(self._last_use)  # the previous stream may still read the cast chunk
        self._last_stream = stream

    def _exit(self) -> None:
        if self._cuda:
            if self._last_use is None:
                self._last_use = torch.cuda.Event()
            self._last_use.record(self._last_stream)

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> int:
        """``dst += src`` (1-D, equal lengths) with atomic adds, in chunks; returns the number of chunks.

        ``dst`` may be a peer's mapped accumulator. A ``src`` of another dtype is cast chunk by chunk into the pool.
        """
        if dst.dtype != self.dtype:
            raise TypeError(f"the staging pool adds into {self.dtype} accumulators, got {dst.dtype}")
        src = src.reshape(-1)
        if src.numel() != dst.numel():
            raise ValueError(f"accumulate of {src.numel()} elements into a buffer of {dst.numel()}")
        if torch.are_deterministic_algorithms_enabled():
            raise RuntimeError(deterministic_refusal())
        chunks = 0
        self._enter()
        try:
            for start, stop in chunk_spans(src.numel(), self.chunk_numel):
                piece = src[start:stop]
                if piece.dtype != self.dtype:
                    if not self.cast.numel():
                        raise TypeError(
                            f"accumulate of {piece.dtype} into {self.dtype}: this pool holds no cast chunk"
                        )
                    self.cast[: stop - start].copy_(piece)
                    piece = self.cast[: stop - start]
                dst[start:stop].index_add_(0, self.index[: stop - start], piece)
                chunks += 1
        finally:
            self._exit()
        return chunks


def deterministic_refusal() -> str:
    return (
        "torch.use_deterministic_algorithms(True) is on, but the 'cuda' ODC transport adds gradients with atomic adds "
        "(in deterministic mode torch's index_add_ is not atomic across processes, and atomic adds sum in varying "
        "order). Turn deterministic algorithms off, set odc_reduction: ordered (no atomic adds: each owner sums the "
        "ranks' gradients in rank order), or use plain FSDP2"
    )


@dataclass(frozen=True)
class DeviceFacts:
    """What one rank knows about its GPU and the GPUs it can see; gathered from every rank before anything is allocated.

    Attributes:
        host (`str`): host identity (`~odc_accelerate.transport.host_id`).
        problem (`str | None`): why this rank cannot use CUDA symmetric memory at all (no GPU, CPU torch, ...).
        uuid (`str`): this rank's GPU.
        visible (`tuple[str, ...]`): UUIDs of every GPU this rank sees, in its device numbering.
        access (`tuple[bool, ...]`): per visible GPU, whether this rank's GPU can map its memory (peer access; True for
            its own GPU).
        atomics (`tuple[bool | None, ...]`): per visible GPU, whether native atomic adds work over that mapping (True for
            its own GPU; None: could not be queried).
        backend (`str`): the symmetric-memory backend this process would allocate with.
        allow_overlap (`bool`): ``$TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES`` is ``1``.
        deterministic (`bool`): ``torch.are_deterministic_algorithms_enabled()``.
        free_bytes (`int`): free memory on this rank's GPU.
        settings (`tuple`): the transport's settings on this rank (staging bytes, accumulator dtype); segments must be
            laid out identically on every rank.
        accumulate_kernel (`bool`): the accumulate kernel can run on this rank: available, and it compiled, launched
            and summed exactly at set-up (`.kernels.probe`).
        accumulate_kernel_reason (`str`): why it can or cannot run here.
    """

    host: str
    problem: str | None = None
    uuid: str = ""
    visible: tuple[str, ...] = ()
    access: tuple[bool, ...] = ()
    atomics: tuple[bool | None, ...] = ()
    backend: str = "CUDA"
    allow_overlap: bool = False
    deterministic: bool = False
    free_bytes: int = 0
    settings: tuple = ()
    accumulate_kernel: bool = False
    accumulate_kernel_reason: str = ""


# What a refusal for missing peer-to-peer atomics offers: the ordered reduction reads peers' memory and never adds
# into it (docs/reduction.md).
_NO_ATOMICS_ADVICE = (
    "To run on these GPUs, set odc_reduction: ordered (ODC_REDUCTION=ordered, --odc_reduction ordered): each owner "
    "then reads the ranks' gradients and sums them itself in rank order, with no atomic adds. Or use plain FSDP2 on "
    "this machine"
)


def device_refusal(facts: Sequence[DeviceFacts], *, atomics: bool = True) -> str | None:
    """Why the ranks described by ``facts`` (indexed by rank) cannot run the CUDA transport, or None if they can.

    The same facts give the same answer on every rank, so all ranks refuse together (none is left waiting in a
    collective). The message names the first problem found and what to change.

    Args:
        facts: every rank's `DeviceFacts`, indexed by rank.
        atomics (`bool`, *optional*, defaults to `True`): peers add into each other's memory (the ``atomic``
            reduction's accumulators): refuse where that cannot be done (`atomics_problem`). False when nothing is
            accumulated (the ``ordered`` reduction, a frozen engine): the ranks only read each other's memory.
    """
    for rank, f in enumerate(facts):
        if f.problem:
            return f"rank {rank}: {f.problem}"
    hosts = sorted({f.host for f in facts})
    if len(hosts) > 1:
        return (
            f"the ranks run on {len(hosts)} hosts ({', '.join(hosts)}); CUDA symmetric memory maps peers within one "
            "node only. Keep the ODC group within a node or use plain FSDP2"
        )
    for rank, f in enumerate(facts):
        if f.settings != facts[0].settings:
            return (
                f"rank {rank} configured the 'cuda' ODC transport as {f.settings} (staging bytes, accumulator dtype) "
                f"but rank 0 as {facts[0].settings}; every rank must use the same staging_mib / ${STAGING_ENV} and "
                "accumulate_dtype"
            )
    for rank, f in enumerate(facts):
        if f.backend.upper() != "CUDA":
            return (
                f"rank {rank} allocates symmetric memory with the {f.backend} backend, but the 'cuda' ODC transport "
                f"needs the CUDA backend (peer mappings it can add into). Unset ${BACKEND_ENV} (or set it to CUDA) "
                "and do not enable FSDP2's symmetric-memory option (set_symm_mem), which selects NCCL"
            )
    by_gpu: dict[str, list[int]] = {}
    for rank, f in enumerate(facts):
        by_gpu.setdefault(f.uuid, []).append(rank)
    # Every group of ranks sharing a GPU is checked: the switch may be set on the ranks of one GPU and not another's.
    for ranks in by_gpu.values():
        without = [r for r in ranks if not facts[r].allow_overlap] if len(ranks) > 1 else []
        if without:
            return (
                f"ranks {ranks} share one GPU, which torch's symmetric memory refuses unless {OVERLAP_ENV}=1 is set "
                f"(missing on rank(s) {without}). Give each rank its own GPU, or set {OVERLAP_ENV}=1 on every rank "
                "(tests and single-GPU checks only: the ranks then time-slice the GPU)"
            )
    for rank, f in enumerate(facts):
        for peer, g in enumerate(facts):
            if peer == rank or g.uuid == f.uuid:
                continue
            if g.uuid not in f.visible:
                return (
                    f"rank {rank} cannot see rank {peer}'s GPU ({g.uuid}): each rank sees only {len(f.visible)} "
                    "GPU(s), e.g. CUDA_VISIBLE_DEVICES set per rank, so peers' memory cannot be mapped. Make every GPU "
                    "of the node visible to every rank and pick the device with torch.cuda.set_device(LOCAL_RANK)"
                )
            j = f.visible.index(g.uuid)
            if not f.access[j]:
                return (
                    f"rank {rank}'s GPU cannot access rank {peer}'s GPU peer-to-peer (no NVLink or PCIe P2P between "
                    "them), so it cannot map its memory. Use plain FSDP2 on this machine"
                )
    if atomics:
        found = _atomics_problem(facts)
        if found:
            return "".join(found)
    return None


def atomics_problem(facts: Sequence[DeviceFacts]) -> str | None:
    """Why the ranks described by ``facts`` cannot add into each other's memory atomically (the ``atomic``
    reduction), or None if they can: deterministic algorithms are on somewhere, or a pair of GPUs has no native
    peer-to-peer atomics (PCIe rather than NVLink) or could not say. The ``ordered`` reduction needs none of it.
    """
    found = _atomics_problem(facts)
    return found[0] if found else None


def _atomics_problem(facts: Sequence[DeviceFacts]) -> tuple[str, str] | None:
    """`atomics_problem`'s text, and the advice a refusal adds to it."""
    for rank, f in enumerate(facts):
        if f.deterministic:
            return f"rank {rank}: {deterministic_refusal()}", ""
    for rank, f in enumerate(facts):
        for peer, g in enumerate(facts):
            if peer == rank or g.uuid == f.uuid or g.uuid not in f.visible:
                continue
            j = f.visible.index(g.uuid)
            if j >= len(f.atomics) or f.atomics[j] is None:
                return (
                    f"could not query whether rank {rank}'s GPU has native atomic adds into rank {peer}'s GPU "
                    "(cuDeviceGetP2PAttribute from the CUDA driver failed); the 'cuda' ODC transport's atomic "
                    "reduction needs them",
                    f". {_NO_ATOMICS_ADVICE}",
                )
            if not f.atomics[j]:
                return (
                    f"rank {rank}'s GPU has no native atomic adds into rank {peer}'s GPU (peer-to-peer over PCIe "
                    "rather than NVLink); the 'cuda' ODC transport's atomic reduction adds gradients with them",
                    f". {_NO_ATOMICS_ADVICE}",
                )
    return None


def choose_reduction(requested: ReductionName, facts: Sequence[DeviceFacts]) -> tuple[ReductionName, str]:
    """The reduction the 'cuda' transport runs, and why, from every rank's facts (the same answer on every rank).

    Args:
        requested: ``odc_reduction``, already checked: kept unless it is ``auto``, which is ``atomic`` unless the GPUs
            cannot add into each other's memory atomically (`atomics_problem`): then ``ordered``, which only reads
            peers' memory, instead of a refusal.
        facts: every rank's `DeviceFacts`, indexed by rank.

    Returns:
        `tuple[ReductionName, str]`: the reduction, and a short reason for logs and the Trainer's banner.
    """
    if requested != ReductionName.AUTO:
        return requested, "set by odc_reduction"
    problem = atomics_problem(facts)
    if problem is None:
        return ReductionName.ATOMIC, "auto: the GPUs add into each other's memory natively"
    return ReductionName.ORDERED, f"auto: {problem}"


def accumulate_kernel_agreement(facts: Sequence[DeviceFacts]) -> tuple[bool, str]:
    """Whether every rank adds with the accumulate kernel, and why (not), from every rank's gathered facts.

    The kernel only if it can run on every rank; else the first rank where it cannot names the reason. Every rank
    decides from the same facts, so all take the same path: the path decides the memory plan (the fallback's staging
    pool), which the memory check compares across ranks.
    """
    for rank, f in enumerate(facts):
        if not f.accumulate_kernel:
            reason = f.accumulate_kernel_reason or "the accumulate kernel was not checked"
            return False, reason if len(facts) == 1 else f"rank {rank}: {reason}"
    return True, facts[0].accumulate_kernel_reason


#: GPU memory each rank must have free beyond the plan when the transport is set up: the first use of its kernels
#: and of symmetric memory grows the CUDA context and torch's peer tables (~70 MiB per rank measured on an H100, not
#: given back before the process ends), and the engine's first publish casts one parameter at a time.
SETUP_MARGIN_BYTES = 128 * 2**20


def memory_refusal(
    plan: SegmentPlan, facts: Sequence[DeviceFacts], margin_bytes: int = SETUP_MARGIN_BYTES
) -> str | None:
    """Why ``plan`` (plus ``margin_bytes`` per rank for set-up) does not fit in the GPUs' free memory (ranks sharing a
    GPU add up), or None if it fits. The same text on every rank: every rank decides from the same gathered facts.

    The check runs before the transport allocates anything, but not before everything the engine's set-up allocates:
    FSDP2's lazy initialisation (its streams and buffers) runs first, and so does reading the size of each parameter
    whose all-gather inputs an all-gather extension makes (FSDP2's ``fsdp_pre_all_gather``, e.g. float8 training):
    only the extension knows them, so the engine builds them once, one parameter at a time (at most one parameter's
    inputs exist at once; they are freed before the check). An out-of-memory error in either is a refusal on every
    rank, raised where the ranks agree on the model.
    """
    by_gpu: dict[str, list[int]] = {}
    for rank, f in enumerate(facts):
        by_gpu.setdefault(f.uuid, []).append(rank)
    for ranks in by_gpu.values():
        need = (plan.device_bytes + margin_bytes) * len(ranks)
        free = min(facts[r].free_bytes for r in ranks)
        if need > free:
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks} (one GPU)"
            return transport_memory_text(who, need, free, plan, margin_bytes)
    return None


def transport_memory_text(
    who: str, need: int, free: int, plan: SegmentPlan, margin_bytes: int, ran_out: str = ""
) -> str:
    """The transport's refusal for too little GPU memory (`odc_accelerate.engine.memory_spec.out_of_memory_text`, with what the
    transport needs memory for and what to lower); ``ran_out`` says what ran out, after an allocation failed."""
    return memory_spec.out_of_memory_text(
        who,
        "the 'cuda' ODC transport",
        need=need,
        detail=f"{plan.describe()} + {_mib(margin_bytes)} set-up margin per rank",
        free=free,
        ran_out=ran_out,
        advice=f"Lower the staging pool (staging_mib / ${STAGING_ENV}), accumulate in bf16 (accumulate_dtype), shard "
        "over more GPUs, or free memory before creating the engine",
    )
