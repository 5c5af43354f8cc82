"""The transport interface: how one rank reads a peer's buffer and adds into an owner's buffer.

ODC needs ``register``, one-sided ``read`` and ``accumulate``, and ``barrier``, none of which may require the peer's
training thread to take part; the ``dynamic`` plan may also use ``claim`` (`odc_accelerate.transport.claims`). Every
wait honours ``timeout`` and names a dead or missing peer in :class:`ODCTimeoutError`. See docs/transports.md.
"""

from __future__ import annotations

import abc
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from ..reduction import ReductionName

HOST_ID_ENV = "ODC_HOST_ID"


def host_id() -> str:
    """Identity of the host this process runs on: ``$ODC_HOST_ID`` if set, else ``hostname/boot_id``.

    Ranks with equal identities must be able to share ``/dev/shm``.
    """
    override = os.environ.get(HOST_ID_ENV)
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is a CUDA out-of-memory error: torch's allocator raises `torch.OutOfMemoryError`, while a
    failed driver allocation (symmetric memory's ``cuMemCreate``) surfaces as a runtime error saying "CUDA error: out
    of memory". ODC's own refusals ("ran out of GPU memory") are not."""
    text = str(err).lower()
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and ("cuda error: out of memory" in text or "cuda out of memory" in text)
    )


class ODCTimeoutError(RuntimeError):
    """A peer did not arrive within the timeout, or died; the current optimizer step is lost.

    Attributes:
        ranks (`list[int]`): the ranks that were missing (or dead).
    """

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


@dataclass(frozen=True, kw_only=True, slots=True)
class BufferSpec:
    """One registered buffer: ``numel`` elements of ``dtype`` (1-D).

    Args:
        numel (`int`): number of elements (>= 0).
        dtype (`torch.dtype`): element type.
        accumulated (`bool`, *optional*, defaults to `False`): peers ``accumulate`` into this buffer (a gradient
            accumulator); transports without remote atomics give only such buffers staging memory.
    """

    numel: int
    dtype: torch.dtype
    accumulated: bool = False

    def __post_init__(self) -> None:
        if self.numel < 0:
            raise ValueError(f"buffer numel must be >= 0, got {self.numel}")
        object.__setattr__(self, "numel", int(self.numel))  # frozen: the one normalisation, at construction

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class Transport(abc.ABC):
    """One-sided communication between the ranks of one ODC job.

    A transport's facts are its class attributes (``name``, ``devices``, ``spans_hosts``, ``adds_atomically``),
    read by `~odc_accelerate.transport.TRANSPORT_CLASSES` and ``"auto"`` (`~odc_accelerate.transport.choose_transport`);
    ``docs/extending.md`` says how to add one.

    Args:
        rank (`int`): this process's rank in the data-parallel group.
        world_size (`int`): number of ranks.
        timeout (`float`): seconds any wait may last before raising :class:`ODCTimeoutError`.
    """

    #: short name used in logs and by ``transport=`` arguments
    name: ClassVar[str] = "abstract"
    #: the device types (``torch.device.type``) whose tensors it moves
    devices: ClassVar[tuple[str, ...]] = ()
    #: its ranks may run on several hosts
    spans_hosts: ClassVar[bool] = False
    #: ``accumulate`` is atomic wherever the transport runs; False: only where the devices allow (`choose_reduction`)
    adds_atomically: ClassVar[bool] = True
    #: how ``accumulate`` adds, for transports with several ways (the ``cuda`` transport's kernel or its fallback), and
    #: why; None: one way
    accumulate_path: str | None = None
    accumulate_reason: str = ""

    def __init__(self, rank: int, world_size: int, timeout: float) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)

    @classmethod
    def create(
        cls,
        rank: int,
        world_size: int,
        *,
        timeout: float,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
    ) -> Transport:
        """Build one from `~odc_accelerate.transport.create_transport`'s arguments (``device``: the model's)."""
        return cls(rank, world_size, timeout=timeout, group=group)

    @classmethod
    def fits_hosts(cls, ranks_per_host: Sequence[int]) -> bool:
        """Whether ``"auto"`` may choose it for ranks laid out so: on one host, or anywhere if it spans hosts."""
        return len(ranks_per_host) == 1 or cls.spans_hosts

    @classmethod
    def auto_refusal(
        cls, *, group: dist.ProcessGroup | None, world_size: int, device: torch.device, atomics: bool
    ) -> str | None:
        """Collective on transports that ask their peers: why ``"auto"`` cannot choose it here (None: it can).

        ``atomics``: peers will add into each other's memory (an explicit ``atomic`` reduction, not frozen).
        """
        return None

    @abc.abstractmethod
    def register(self, specs: Mapping[str, BufferSpec]) -> dict[str, torch.Tensor]:
        """Collective: expose the same named buffers on every rank (zero-initialised).

        Returns this rank's own buffers, which the caller may read and write directly.
        """

    @abc.abstractmethod
    def read(self, peer: int, name: str, out: torch.Tensor) -> None:
        """Copy ``peer``'s buffer ``name`` into ``out`` without the peer taking part."""

    @abc.abstractmethod
    def accumulate(self, owner: int, name: str, src: torch.Tensor) -> None:
        """``owner``'s buffer ``name`` ``+= src``, atomic with respect to other ranks' accumulates."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait until every rank has called ``barrier`` as often as this one.

        On return, every ``accumulate`` that any rank issued before its call has been applied to this rank's own
        buffers, and everything peers wrote into their own buffers before their call is visible to ``read``.

        Raises:
            ODCTimeoutError: a rank did not arrive within ``timeout`` or died; names the rank(s).
        """

    #: whether `claim` is this transport's own atomic counter (else `claims.claim_counter` uses the store fallback)
    has_claims: bool = False

    def claim(self, round: int) -> int:
        """Atomic fetch-and-add on the claim counter of ``round``: the value before the add (0, 1, 2, ... per round).

        Every rank draws from one counter per round; each value is returned to exactly one caller. Rounds are
        positive and increase by at least one from one optimizer step to the next, and every rank's claims of a round
        happen before any rank's claims of the next (a ``barrier`` between them): the first claim of a new round
        starts its count at 0. See `odc_accelerate.transport.claims`.

        Raises:
            ODCTimeoutError: the counter could not be reached within ``timeout`` (its holder hung or died).
        """
        raise NotImplementedError(f"the {self.name!r} transport has no claim counter; use claims.claim_counter")

    def flush(self) -> None:
        """Wait until the operations this rank enqueued asynchronously (GPU streams) have completed locally.

        ``barrier`` flushes too; calling it first lets a caller tell this rank's own queued work apart from time
        blocked on peers. Synchronous transports have nothing to flush.
        """
        return None

    def choose_reduction(self, requested: ReductionName) -> tuple[ReductionName, str]:
        """Collective on transports that ask their peers: the gradient reduction to run, and why (for logs).

        ``requested`` (checked by the caller) is kept unless it is ``auto``: then ``atomic`` where this transport adds
        atomically (`adds_atomically`), else ``ordered``, which adds nothing into peers' memory.
        """
        if requested != ReductionName.AUTO:
            return requested, "set by odc_reduction"
        if self.adds_atomically:
            return ReductionName.ATOMIC, f"auto: the {self.name} transport adds atomically"
        return ReductionName.ORDERED, f"auto: the {self.name} transport may not add atomically"

    def memory_report(self) -> dict[str, int]:
        """Device memory this transport holds, in bytes by purpose plus ``"total"``; empty for host memory."""
        return {}

    @abc.abstractmethod
    def close(self) -> None:
        """Release every resource; idempotent. Peers' buffers stay valid for peers that still use them."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
