"""The network transport's service: the side of a rank that serves its buffers to its peers.

A listening socket and one handler thread per peer: reads are served from the owner's buffer, adds applied in chunks
under a per-buffer lock, each connection's messages in order (so a barrier arrival stands for every add sent before
it). Peers' hellos, arrivals, goodbyes and reported failures go into `PeerStatus`; rank 0's service also answers
``claim``. See docs/transports.md, "Protocol details".
"""

from __future__ import annotations

import logging
import socket
import threading
import weakref
from collections.abc import Callable, Mapping

import torch

from ..base import BufferSpec
from .wire import (
    ABORT,
    ACCUMULATE,
    ARRIVE,
    BYE,
    CLAIM,
    CLAIM_REPLY,
    HEADER,
    HELLO,
    HELLO_OK,
    JOB_BYTES,
    READ,
    byte_view,
    recv_exact,
)

logger = logging.getLogger(__name__)

#: bytes received and added per lock hold; bounds the per-connection staging memory
DEFAULT_CHUNK_BYTES = 4 << 20

#: what a service calls to add ``src`` into its own buffer ``name`` at element ``offset`` (under its own locking)
AddFn = Callable[[str, int, torch.Tensor], None]


class PeerStatus:
    """What this rank's service has heard from each peer, shared with the training thread.

    The handler threads and the training thread read and write it only under ``changed``, which is notified on every
    change (the training thread sets the job id and records failures it saw first, and waits for the rest).

    Attributes:
        changed (`threading.Condition`): guards every attribute below.
        job_id (`str`, *optional*): the job's id, once the ranks agreed on it; a handler waits for it to check a hello.
        connected (`set[int]`): peers whose hello was accepted.
        arrived (`list[int]`): each peer's latest barrier arrival counter.
        said_bye (`list[bool]`): peers that closed their transport.
        failed (`dict[int, str]`): ranks known to have failed, and how.
    """

    def __init__(self, world_size: int) -> None:
        self.changed = threading.Condition()
        self.job_id: str | None = None
        self.connected: set[int] = set()
        self.arrived = [0] * world_size
        self.said_bye = [False] * world_size
        self.failed: dict[int, str] = {}


class NetworkService:
    """Serves this rank's buffers to its peers from background threads: reads, adds and rank 0's claim counter.

    Args:
        rank (`int`): this rank.
        world_size (`int`): number of ranks.
        timeout (`float`): seconds a handler waits for the job id before it checks a peer's hello.
        chunk_bytes (`int`, *optional*, defaults to 4 MiB): bytes received and added per lock hold.
    """

    def __init__(self, rank: int, world_size: int, timeout: float, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if chunk_bytes < 64 or chunk_bytes % 16:
            raise ValueError(f"chunk_bytes must be a positive multiple of 16 (>= 64), got {chunk_bytes}")
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._chunk_bytes = int(chunk_bytes)
        #: the served buffers' specs, their names in index order (the wire's buffer index), and the buffers
        self.specs: dict[str, BufferSpec] = {}
        self.index: dict[str, int] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self._names: list[str] = []
        self._locks: dict[str, threading.Lock] = {}
        self._add: AddFn | None = None
        self.status = PeerStatus(world_size)
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._claim_lock = threading.Lock()
        self._claim_round = 0
        self._claim_next = 0
        self._closing = False
        self._finalizer: weakref.finalize | None = None

    def serve(
        self,
        specs: Mapping[str, BufferSpec],
        buffers: Mapping[str, torch.Tensor],
        *,
        address: str,
        add: AddFn | None = None,
    ) -> int:
        """Serve ``buffers`` (this rank's memory for ``specs``) on ``address``; return the port it listens on.

        Args:
            specs (`Mapping[str, BufferSpec]`): the buffers, in the order every rank registers them.
            buffers (`Mapping[str, torch.Tensor]`): a contiguous CPU tensor per spec, owned by the caller (it may live
                elsewhere, e.g. in shared memory).
            address (`str`): IPv4 address to bind.
            add (`Callable`, *optional*): what adds ``src`` into buffer ``name`` at element ``offset``, called as
                ``add(name, offset, src)`` by the handler threads and by `add`; for buffers that need their own
                locking. Defaults to an add under a per-buffer lock.
        """
        if len(specs) >= 2**16:
            raise ValueError(f"NetworkTransport supports at most 65535 buffers, got {len(specs)}")
        for name, spec in specs.items():
            buf = buffers[name]
            if buf.device.type != "cpu" or not buf.is_contiguous() or buf.numel() != spec.numel:
                raise ValueError(f"buffer {name!r} must be a contiguous CPU tensor of {spec}; got {buf.shape}")
        self.specs = dict(specs)
        self._names = list(specs)
        self.index = {name: i for i, name in enumerate(self._names)}
        self.buffers = dict(buffers)
        self._locks = {name: threading.Lock() for name in self._names}
        self._add = add or self._locked_add

        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener = listener
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((address, 0))
        except OSError as err:
            listener.close()
            self._listener = None
            raise RuntimeError(
                f"NetworkTransport on rank {self.rank} could not bind {address!r}: {err}. Pass address= with an "
                "IPv4 address of this host that the other ranks can reach"
            ) from err
        listener.listen(max(self.world_size, 8))
        self.set_outgoing({})
        self._start_thread(self._accept_loop, "accept")
        return listener.getsockname()[1]

    def set_outgoing(self, peers: Mapping[int, socket.socket]) -> None:
        """The outgoing connections to this rank's peers, which tear-down says goodbye over and closes with the
        service's own sockets.

        Tear-down runs at `shutdown`, or when the service is collected (its threads hold it while they run) or the
        interpreter exits: no thread outlives the service even if nobody calls `shutdown`.
        """
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _shutdown_sockets, self._listener, self._conns, dict(peers))

    def add(self, name: str, offset: int, src: torch.Tensor) -> None:
        """Add ``src`` into this rank's buffer ``name`` from element ``offset`` on, serialised with the handlers."""
        self._add(name, offset, src)

    @property
    def listening(self) -> bool:
        """Whether `serve` got as far as binding its socket (it may be called once)."""
        return self._listener is not None

    def claim(self, round: int) -> int:
        """Rank 0's side of `NetworkTransport.claim`: one lock serialises the service threads and the training
        thread."""
        with self._claim_lock:
            if round != self._claim_round:
                self._claim_round, self._claim_next = round, 0
            index = self._claim_next
            self._claim_next += 1
        return index

    def shutdown(self) -> None:
        """Say goodbye to the peers, shut every socket down (blocked threads return at once) and join the threads."""
        self._closing = True
        if self._finalizer is not None:
            self._finalizer()
        elif self._listener is not None:
            self._listener.close()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:  # pragma: no cover - a handler stuck in an add
            logger.warning("network transport threads still running after close: %s", alive)
        self._threads = []

    def _start_thread(self, target: Callable, what: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=f"odc-net-r{self.rank}-{what}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        listener = self._listener
        while not self._closing:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # listener shut down by close()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns.append(conn)
            self._start_thread(self._serve, f"serve{len(self._conns)}", conn)

    def _serve(self, conn: socket.socket) -> None:
        """One peer's connection: its messages, in order, until it says goodbye or the connection is lost."""
        status = self.status
        header = bytearray(HEADER.size)
        hview = memoryview(header)
        peer = -1
        staging: torch.Tensor | None = None
        try:
            recv_exact(conn, hview)
            op, _, peer, _ = HEADER.unpack(header)
            job = bytearray(JOB_BYTES)
            recv_exact(conn, memoryview(job))
            with status.changed:
                # A fast peer may connect before this rank's all_gather_object has returned the job id.
                status.changed.wait_for(lambda: status.job_id is not None or self._closing, self.timeout)
            if op != HELLO or not 0 <= peer < self.world_size or job.decode().strip() != (status.job_id or ""):
                logger.warning("rank %d rejected a connection that is not from this ODC job", self.rank)
                peer = -1
                return
            conn.sendall(HELLO_OK)
            with status.changed:
                status.connected.add(peer)
                status.changed.notify_all()
            while True:
                recv_exact(conn, hview)
                op, index, a, b = HEADER.unpack(header)
                if op == READ:
                    conn.sendall(byte_view(self.buffers[self._names[index]]))
                elif op == ACCUMULATE:
                    if staging is None:
                        staging = torch.empty(self._chunk_bytes, dtype=torch.uint8)
                    self._receive_add(conn, self._names[index], a, b, staging)
                elif op == CLAIM:
                    conn.sendall(CLAIM_REPLY.pack(self.claim(a)))
                elif op == ARRIVE:
                    with status.changed:
                        status.arrived[peer] = max(status.arrived[peer], a)
                        status.changed.notify_all()
                elif op == ABORT:
                    # The sender saw rank ``a`` die and is giving up; remember the cause, so that when the sender's
                    # own exit is noticed here the root cause is named too.
                    with status.changed:
                        status.failed.setdefault(a, f"reported dead by rank {peer}")
                        status.changed.notify_all()
                elif op == BYE:
                    with status.changed:
                        status.said_bye[peer] = True
                        status.changed.notify_all()
                    return
                else:
                    raise ConnectionError(f"unknown message type {op}")
        except (OSError, ConnectionError, IndexError, ValueError) as err:
            if peer >= 0 and not self._closing:
                with status.changed:
                    status.failed.setdefault(peer, f"connection lost ({err})")
                    status.changed.notify_all()
        finally:
            try:
                conn.close()
            except OSError:
                pass

    def _receive_add(self, conn: socket.socket, name: str, nbytes: int, offset: int, staging: torch.Tensor) -> None:
        dtype = self.specs[name].dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        view = byte_view(staging)
        done = 0
        while done < nbytes:
            n = min(self._chunk_bytes, nbytes - done)
            recv_exact(conn, view[:n])
            # Received outside the lock; only the add itself is serialised against other adders.
            self._add(name, (offset + done) // itemsize, staging[:n].view(dtype))
            done += n

    def _locked_add(self, name: str, offset: int, src: torch.Tensor) -> None:
        with self._locks[name]:
            self.buffers[name][offset : offset + src.numel()].add_(src)


def _shutdown_sockets(listener: socket.socket, conns: list[socket.socket], peers: dict[int, socket.socket]) -> None:
    """Say goodbye over each outgoing connection in ``peers``, then shut down and close every socket."""
    for sock in peers.values():
        try:
            sock.sendall(HEADER.pack(BYE, 0, 0, 0))
        except OSError:
            pass
    for sock in [listener, *conns, *peers.values()]:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            sock.close()
        except OSError:
            pass
