"""CUDA transport for the GPUs of one node: torch symmetric memory for data, shared memory for control.

**Unverified on GPUs**: written and unit-tested (the device-independent parts, on CPU) on a machine without a GPU.

Data plane. Every rank allocates one segment with ``torch.distributed._symmetric_memory.empty`` (through
:mod:`odc_accelerate._compat.fsdp`, which holds every torch internal the project uses) and maps every
peer's segment after ``rendezvous`` (``handle.get_buffer``; CUDA IPC / NVLink underneath). A segment holds, per
registered buffer, the buffer itself and, for buffers that receive ``accumulate``, one *staging slot per sender*:

* ``read(peer, name, out)`` is ``out.copy_(peer_view)`` enqueued on the caller's current stream: the published shard
  is already there, so nothing waits for the peer and the host does not block;
* ``accumulate(owner, name, src)`` is ``owner_slot[me].add_(src)`` enqueued on the current stream: a peer-to-peer
  read-modify-write of a slot that only this rank ever writes, so no atomics or locks are needed;
* the owner reduces: after the step's barrier it adds every slot written since the last barrier into its buffer, in
  sender order, and zeroes those slots, on its current stream.

Why staging + owner reduction and not a locked add: GPUs have no remote float atomic add over CUDA IPC that torch
exposes, and a lock held across an asynchronous kernel would force the sender's host to wait for the add to finish
before unlocking, stalling the stream pipeline on every layer. Per-sender slots need no lock and no host wait, and
the fixed reduction order makes gradients bitwise reproducible whatever order the adds arrive in. The cost is
memory: ``world_size - 1`` slots per accumulated buffer (together the size of an unsharded gradient, in
``reduce_dtype``) and one extra pass over them per step. Accumulates into a peer therefore become visible in the
owner's buffer at the next ``barrier``, which is when the engine reads them.

Control plane. A small :class:`~odc_accelerate.transport.shm.ShmTransport` gives the barrier (with its timeout and
dead-peer detection) and a per-rank ledger of how many adds this rank sent into each (owner, buffer), so an owner
reduces only the slots that changed. ``barrier`` first synchronises the device (every enqueued add and publish has
landed) and then meets the peers on the host: one device sync per barrier, none per layer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from .base import BufferSpec, Transport
from .shm import ShmTransport

logger = logging.getLogger(__name__)

#: byte alignment of every buffer and slot in a segment (wide vector loads, any dtype's storage offset)
ALIGN = 256


def cuda_unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why the CUDA transport cannot run here (a sentence naming what is missing), or None if it can."""
    if device is not None and torch.device(device).type != "cuda":
        return f"the model is on {torch.device(device).type}, not cuda"
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support; install a CUDA build of torch"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False: no usable GPU or driver"
    from .._compat import fsdp as compat  # imported here: the CPU transports need no FSDP2 internals

    return compat.symmetric_memory_unavailable_reason()


def _aligned(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALIGN) * ALIGN


def slot_index(owner: int, sender: int) -> int:
    """Which of the owner's ``world_size - 1`` staging slots belongs to ``sender`` (the owner has none for itself)."""
    if owner == sender:
        raise ValueError(f"rank {owner} adds into its own buffer directly; it has no staging slot")
    return sender if sender < owner else sender - 1


class StagingLayout:
    """Byte layout of one rank's segment; identical on every rank.

    Args:
        specs: the registered buffers, in registration order.
        world_size: number of ranks.
    Buffers registered with ``accumulated=True`` receive ``accumulate`` and so get ``world_size - 1`` staging
    slots each.
    """

    def __init__(self, specs: Mapping[str, BufferSpec], world_size: int) -> None:
        self.specs = dict(specs)
        self.world_size = world_size
        self.offsets: dict[str, int] = {}
        self.slot_bases: dict[str, int] = {}
        self.staged_names = [name for name, spec in specs.items() if spec.accumulated]
        offset = 0
        for name, spec in specs.items():
            self.offsets[name] = offset
            offset += _aligned(spec.nbytes)
        for name in self.staged_names:
            self.slot_bases[name] = offset
            offset += (world_size - 1) * _aligned(self.specs[name].nbytes)
        self.total_bytes = max(offset, ALIGN)

    def slot_offset(self, name: str, owner: int, sender: int) -> int:
        """Byte offset, in ``owner``'s segment, of ``sender``'s staging slot for buffer ``name``."""
        if name not in self.slot_bases:
            raise KeyError(f"buffer {name!r} is not staged: nothing may accumulate into it on this transport")
        return self.slot_bases[name] + slot_index(owner, sender) * _aligned(self.specs[name].nbytes)

    def view(self, segment: torch.Tensor, offset: int, name: str) -> torch.Tensor:
        spec = self.specs[name]
        return segment[offset : offset + spec.nbytes].view(spec.dtype)


class StagedBuffers:
    """The data plane over ``segments[r]`` (rank ``r``'s segment as this rank sees it, any device).

    Device-independent: on GPUs the segments are symmetric-memory mappings, in tests plain CPU tensors.
    """

    def __init__(self, layout: StagingLayout, rank: int, segments: Sequence[torch.Tensor]) -> None:
        self.layout = layout
        self.rank = rank
        world = layout.world_size
        self.staged_index = {name: k for k, name in enumerate(layout.staged_names)}
        self.views = [
            {name: layout.view(seg, layout.offsets[name], name) for name in layout.specs} for seg in segments
        ]
        # outgoing[owner][name]: this rank's slot in the owner's segment
        self.outgoing = [
            {name: layout.view(segments[o], layout.slot_offset(name, o, rank), name) for name in layout.staged_names}
            if o != rank
            else {}
            for o in range(world)
        ]
        # incoming[sender][name]: the sender's slot in this rank's segment
        own = segments[rank]
        self.incoming = [
            {name: layout.view(own, layout.slot_offset(name, rank, s), name) for name in layout.staged_names}
            if s != rank
            else {}
            for s in range(world)
        ]
        # sent[owner, k]: adds this rank sent into owner's staged buffer k (published to the owner as a ledger)
        self.sent = torch.zeros(world, len(layout.staged_names), dtype=torch.int64)
        self.seen = torch.zeros(world, len(layout.staged_names), dtype=torch.int64)

    def read(self, peer: int, name: str, out: torch.Tensor) -> None:
        out.copy_(self.views[peer][name].view(out.shape), non_blocking=True)

    def accumulate(self, owner: int, name: str, src: torch.Tensor) -> None:
        if owner == self.rank:
            self.views[owner][name].add_(src.reshape(-1))
            return
        if name not in self.staged_index:
            raise KeyError(f"buffer {name!r} is not staged: nothing may accumulate into it on this transport")
        # Single writer per slot: a plain (peer-to-peer) add, ordered on the caller's stream.
        self.outgoing[owner][name].add_(src.reshape(-1))
        self.sent[owner, self.staged_index[name]] += 1

    def dirty(self, ledgers: Mapping[int, torch.Tensor]) -> list[tuple[str, int]]:
        """(buffer, sender) slots written since the last reduction, from each sender's ``sent[self.rank]`` row."""
        out = []
        for sender, row in sorted(ledgers.items()):
            changed = (row != self.seen[sender]).nonzero().flatten().tolist()
            self.seen[sender] = row
            out.extend((self.layout.staged_names[k], sender) for k in changed)
        return sorted(out, key=lambda item: (self.staged_index[item[0]], item[1]))

    def reduce(self, slots: list[tuple[str, int]]) -> None:
        """Owner-side reduction: add the given slots into this rank's buffers in sender order, zero them."""
        own = self.views[self.rank]
        for name, sender in slots:
            slot = self.incoming[sender][name]
            own[name].add_(slot)
            slot.zero_()


class CudaTransport(Transport):
    """One-sided reads and staged accumulates between the GPUs of one node through torch symmetric memory.

    **Unverified on GPUs** (written on a CPU-only machine; its device-independent logic is unit-tested on CPU).

    Args:
        rank (`int`): this rank.
        world_size (`int`): number of ranks (all on this node).
        timeout (`float`, *optional*, defaults to 600.0): seconds a barrier may wait.
        group (`torch.distributed.ProcessGroup`, *optional*): the ODC group, used inside ``register`` only.
        device (`torch.device`, *optional*): this rank's GPU; defaults to the current CUDA device.
    """

    name = "cuda"

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout: float = 600.0,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(rank, world_size, timeout)
        self._group = group
        self._device = torch.device(device) if device is not None else None
        self._control: ShmTransport | None = None
        self._data: StagedBuffers | None = None
        self._handle = None
        self._segment: torch.Tensor | None = None
        self._ledger: torch.Tensor | None = None
        self._closed = False

    @property
    def job_id(self) -> str | None:
        return self._control.job_id if self._control is not None else None

    def register(self, specs: Mapping[str, BufferSpec]) -> dict[str, torch.Tensor]:
        device = self._device or (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        )
        reason = cuda_unavailable_reason(device or torch.device("cuda"))
        if reason:
            raise RuntimeError(f"the 'cuda' ODC transport cannot run: {reason}. Use transport='auto' or a CPU model")
        from .._compat import fsdp as compat

        layout = StagingLayout(specs, self.world_size)
        # Control plane first: it also checks that every rank is on this host (CUDA IPC cannot cross hosts).
        self._control = ShmTransport(self.rank, self.world_size, timeout=self.timeout, group=self._group)
        ledger_spec = BufferSpec(numel=self.world_size * len(layout.staged_names), dtype=torch.int64)
        self._ledger = self._control.register({"sent": ledger_spec})["sent"]
        self._segment = compat.symmetric_segment(layout.total_bytes, device)
        self._segment.zero_()
        self._handle = compat.symmetric_rendezvous(self._segment, self._group or dist.group.WORLD)
        segments = [
            self._segment if peer == self.rank else compat.peer_segment(self._handle, peer, layout.total_bytes)
            for peer in range(self.world_size)
        ]
        self._data = StagedBuffers(layout, self.rank, segments)
        torch.cuda.synchronize(device)  # zeroed before any peer can add
        self._control.barrier()
        logger.info(
            "cuda transport up: rank %d/%d on %s, %.1f MiB symmetric memory (%d staged buffers)",
            self.rank,
            self.world_size,
            device,
            layout.total_bytes / 2**20,
            len(layout.staged_names),
        )
        return dict(self._data.views[self.rank])

    def read(self, peer: int, name: str, out: torch.Tensor) -> None:
        self._data.read(peer, name, out)

    def accumulate(self, owner: int, name: str, src: torch.Tensor) -> None:
        self._data.accumulate(owner, name, src)

    def barrier(self) -> None:
        data = self._data
        # Every add and publish this rank enqueued (on any stream) has landed before peers are told so.
        torch.cuda.synchronize(self._segment.device)
        self._ledger.copy_(data.sent.view(-1))
        self._control.barrier()
        row = torch.empty(self.world_size, len(data.layout.staged_names), dtype=torch.int64)
        ledgers = {}
        for peer in range(self.world_size):
            if peer != self.rank:
                self._control.read(peer, "sent", row.view(-1))
                ledgers[peer] = row[self.rank].clone()
        data.reduce(data.dirty(ledgers))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._data = None
        self._handle = None
        self._segment = None
        if self._control is not None:
            self._control.close()
