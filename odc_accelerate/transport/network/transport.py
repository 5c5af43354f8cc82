"""Network transport: one-sided reads and accumulates over TCP, served by a background thread on each owner.

Ranks on different hosts share no memory, so every rank runs a small service (:class:`NetworkTransport`) that owns
its registered buffers and answers peers without the training thread taking part:

* a listening socket and one handler thread per connected peer. A handler serves ``read`` requests straight from
  the owner's buffer and applies ``accumulate`` payloads in chunks under a per-buffer lock (the owner's own
  ``accumulate`` into itself takes the same lock), so concurrent adds from many ranks lose nothing;
* one persistent outgoing connection per peer (``TCP_NODELAY``) used by the training thread. Tensor bytes go to
  and come from the kernel without extra copies (``memoryview`` of the tensor's storage);
* accumulates are fire-and-forget: TCP keeps a connection's messages in order and each handler processes its
  connection sequentially, so when rank ``r``'s barrier arrival reaches owner ``o``, every add ``r`` sent to ``o``
  before it has already been applied. This is what makes one barrier per optimizer step enough, and it keeps the
  round trip off the scatter path;
* ``claim`` (the ``dynamic`` plan's fetch-and-add) is served by rank 0: its service thread (or its own training
  thread) reads and bumps the round's counter under one lock and answers with the value before the add;
* ``barrier`` sends an arrival (a counter) to every peer and waits until every peer's arrival has reached this
  rank's service. A peer whose connection closes without a goodbye (a crash, ``SIGKILL``) is noticed by the
  handler at once and named in :class:`~odc_accelerate.transport.ODCTimeoutError`; so is a peer that closed its
  transport or a send/receive that fails. Every socket wait honours ``timeout``.

``register`` is the only place that uses ``torch.distributed`` (one ``all_gather_object`` over ``group`` to swap
addresses and agree on a job id); connections carry that job id so a stray client cannot join.

Addresses: the service binds one IPv4 address, by default the local address of the interface that routes to
``MASTER_ADDR`` (the one torch.distributed itself reaches the other ranks through), else the host name's address.
Pass ``address=`` to choose.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from ..base import BufferSpec, ODCTimeoutError, Transport

logger = logging.getLogger(__name__)

# Message header: op, buffer index, a (bytes or counter), b (byte offset).
_HEADER = struct.Struct("<BxHxxxxQQ")
_HELLO, _READ, _ACC, _ARRIVE, _BYE, _ABORT, _CLAIM = 1, 2, 3, 4, 5, 6, 7
_CLAIM_REPLY = struct.Struct("<Q")
_HELLO_OK = b"\x01"
_JOB_BYTES = 16
#: bytes received and added per lock hold; bounds the per-connection staging memory
DEFAULT_CHUNK_BYTES = 4 << 20
# Payloads up to this size are sent with their header in one syscall (one TCP segment) at the cost of a copy.
_COALESCE_BYTES = 64 << 10

#: what a service calls to add ``src`` into its own buffer ``name`` at element ``offset`` (under its own locking)
AddFn = Callable[[str, int, torch.Tensor], None]


def default_address() -> str:
    """The local IPv4 address other ranks can reach this one at.

    The address of the interface that routes to ``MASTER_ADDR`` (no packet is sent: a UDP ``connect`` only picks a
    route), else the address the host name resolves to, else loopback.
    """
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, 9))
                return probe.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU tensor, sharing its memory (works for bfloat16, which numpy lacks)."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; raise ConnectionError if the peer closes first."""
    got, total = 0, len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            raise ConnectionError("connection closed by peer")
        got += n


def _send_msg(sock: socket.socket, header: bytes, payload: memoryview | None = None) -> None:
    if payload is None:
        sock.sendall(header)
    elif len(payload) <= _COALESCE_BYTES:
        sock.sendall(header + payload.tobytes())
    else:
        sock.sendall(header)
        sock.sendall(payload)


class _Peer:
    """This rank's outgoing connection to one peer's service (used by the training thread only)."""

    __slots__ = ("sock", "lock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()


class NetworkTransport(Transport):
    """One-sided reads and accumulates over TCP, each owner's buffers served by a background thread.

    Works across hosts (and inside one host, without shared memory). CPU tensors only.

    Args:
        rank (`int`): this rank.
        world_size (`int`): number of ranks.
        timeout (`float`, *optional*, defaults to 600.0): seconds any wait (barrier, socket send or receive,
            connection set-up) may last before :class:`~odc_accelerate.transport.ODCTimeoutError`.
        group (`torch.distributed.ProcessGroup`, *optional*): used only inside ``register`` to swap addresses.
            Defaults to the world group.
        address (`str`, *optional*): IPv4 address to bind and advertise. Defaults to :func:`default_address`.
        chunk_bytes (`int`, *optional*, defaults to 4 MiB): bytes an owner receives and adds per lock hold.
    """

    name = "network"

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout: float = 600.0,
        group: dist.ProcessGroup | None = None,
        address: str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        super().__init__(rank, world_size, timeout)
        if chunk_bytes < 64 or chunk_bytes % 16:
            raise ValueError(f"chunk_bytes must be a positive multiple of 16 (>= 64), got {chunk_bytes}")
        self._group = group
        self._address = address
        self._chunk_bytes = int(chunk_bytes)
        self.job_id: str | None = None
        self._specs: dict[str, BufferSpec] = {}
        self._names: list[str] = []
        self._index: dict[str, int] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._add_fn: AddFn | None = None
        self._peers: dict[int, _Peer] = {}
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._state = threading.Condition()
        # Written by handler threads under ``_state``: latest arrival counter, goodbye and failure per peer.
        self._arrived = [0] * world_size
        self._said_bye = [False] * world_size
        self._failed: dict[int, str] = {}
        self._hello = set()
        self._counter = 0
        self._claim_lock = threading.Lock()
        self._claim_round = 0
        self._claim_next = 0
        self._closing = False
        self._closed = False
        self._finalizer: weakref.finalize | None = None
        self.endpoints: list[tuple[str, int]] = []

    # ------------------------------------------------------------------ set-up
    def register(self, specs: Mapping[str, BufferSpec]) -> dict[str, torch.Tensor]:
        buffers = {name: torch.zeros(spec.numel, dtype=spec.dtype) for name, spec in specs.items()}
        self._register(specs, buffers, add_fn=None)
        return dict(buffers)

    def _register(self, specs: Mapping[str, BufferSpec], buffers: Mapping[str, torch.Tensor], add_fn: AddFn | None):
        """Serve ``buffers`` (this rank's memory for ``specs``); ``add_fn`` replaces the default locked add.

        For composite transports whose buffers live elsewhere (e.g. shared memory) and need their own locking.
        """
        if self._listener is not None or self._closed:
            raise RuntimeError("NetworkTransport.register may be called only once")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("NetworkTransport.register needs an initialised torch.distributed process group")
        if len(specs) >= 2**16:
            raise ValueError(f"NetworkTransport supports at most 65535 buffers, got {len(specs)}")
        for name, spec in specs.items():
            buf = buffers[name]
            if buf.device.type != "cpu" or not buf.is_contiguous() or buf.numel() != spec.numel:
                raise ValueError(f"buffer {name!r} must be a contiguous CPU tensor of {spec}; got {buf.shape}")
        self._specs = dict(specs)
        self._names = list(specs)
        self._index = {name: i for i, name in enumerate(self._names)}
        self._buffers = dict(buffers)
        self._locks = {name: threading.Lock() for name in self._names}
        self._add_fn = add_fn or self._locked_add

        address = self._address or default_address()
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
        port = listener.getsockname()[1]
        # Threads must not outlive the transport even if nobody calls close().
        self._finalizer = weakref.finalize(self, NetworkTransport._shutdown_sockets, listener, self._conns, {})
        self._start_thread(self._accept_loop, "accept")

        spec_list = [(name, spec.numel, str(spec.dtype)) for name, spec in specs.items()]
        info = {
            "job": uuid.uuid4().hex[:_JOB_BYTES] if self.rank == 0 else None,
            "address": address,
            "port": port,
            "specs": spec_list,
        }
        infos: list[dict] = [None] * self.world_size  # type: ignore[list-item]
        dist.all_gather_object(infos, info, group=self._group)
        bad = [r for r, i in enumerate(infos) if i["specs"] != spec_list]
        if bad:
            raise ValueError(f"ranks {bad} registered different buffers than rank {self.rank}: models differ")
        with self._state:
            self.job_id = infos[0]["job"]
            self._state.notify_all()  # handlers of early peers wait for it to check their hello
        self.endpoints = [(i["address"], i["port"]) for i in infos]
        deadline = time.monotonic() + self.timeout
        for peer in range(self.world_size):
            if peer != self.rank:
                self._peers[peer] = self._connect(peer, deadline)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(
            self, NetworkTransport._shutdown_sockets, listener, self._conns, dict(self._peers)
        )
        # Every peer has connected to us too before we return, so that a crash is noticed from now on.
        with self._state:
            missing = self._wait(lambda: [p for p in self._peers if p not in self._hello], deadline)
        if missing:
            raise ODCTimeoutError(
                f"NetworkTransport on rank {self.rank}: rank(s) {missing} did not connect within {self.timeout:.0f}s",
                missing,
            )
        logger.info(
            "network transport up: job %s, rank %d/%d serving %s:%d, %.1f MiB",
            self.job_id,
            self.rank,
            self.world_size,
            address,
            port,
            sum(s.nbytes for s in specs.values()) / 2**20,
        )
        return self._buffers

    def _connect(self, peer: int, deadline: float) -> _Peer:
        address, port = self.endpoints[peer]
        while True:
            try:
                sock = socket.create_connection((address, port), timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as err:
                if time.monotonic() > deadline:
                    raise ODCTimeoutError(
                        f"NetworkTransport on rank {self.rank} could not connect to rank {peer} at {address}:{port}: "
                        f"{err}. Check that the hosts can reach each other (firewall, address= / MASTER_ADDR)",
                        [peer],
                    ) from err
                time.sleep(0.05)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.timeout)
        try:
            sock.sendall(_HEADER.pack(_HELLO, 0, self.rank, 0) + self.job_id.encode().ljust(_JOB_BYTES))
            reply = bytearray(1)
            _recv_exact(sock, memoryview(reply))
        except (OSError, ConnectionError) as err:
            sock.close()
            raise ODCTimeoutError(f"rank {peer} refused rank {self.rank}'s connection: {err}", [peer]) from err
        return _Peer(sock)

    def _start_thread(self, target: Callable, what: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=f"odc-net-r{self.rank}-{what}", daemon=True)
        self._threads.append(thread)
        thread.start()

    # ------------------------------------------------------------- service side
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
        header = bytearray(_HEADER.size)
        hview = memoryview(header)
        peer = -1
        staging: torch.Tensor | None = None
        try:
            _recv_exact(conn, hview)
            op, _, peer, _ = _HEADER.unpack(header)
            job = bytearray(_JOB_BYTES)
            _recv_exact(conn, memoryview(job))
            with self._state:
                # A fast peer may connect before this rank's all_gather_object has returned the job id.
                self._state.wait_for(lambda: self.job_id is not None or self._closing, self.timeout)
            if op != _HELLO or not 0 <= peer < self.world_size or job.decode().strip() != (self.job_id or ""):
                logger.warning("rank %d rejected a connection that is not from this ODC job", self.rank)
                peer = -1
                return
            conn.sendall(_HELLO_OK)
            with self._state:
                self._hello.add(peer)
                self._state.notify_all()
            while True:
                _recv_exact(conn, hview)
                op, index, a, b = _HEADER.unpack(header)
                if op == _READ:
                    conn.sendall(_byte_view(self._buffers[self._names[index]]))
                elif op == _ACC:
                    if staging is None:
                        staging = torch.empty(self._chunk_bytes, dtype=torch.uint8)
                    self._receive_add(conn, self._names[index], a, b, staging)
                elif op == _CLAIM:
                    conn.sendall(_CLAIM_REPLY.pack(self._claim_here(a)))
                elif op == _ARRIVE:
                    with self._state:
                        self._arrived[peer] = max(self._arrived[peer], a)
                        self._state.notify_all()
                elif op == _ABORT:
                    # The sender saw rank ``a`` die and is giving up; remember the cause, so that when the sender's
                    # own exit is noticed here the root cause is named too.
                    with self._state:
                        self._failed.setdefault(a, f"reported dead by rank {peer}")
                        self._state.notify_all()
                elif op == _BYE:
                    with self._state:
                        self._said_bye[peer] = True
                        self._state.notify_all()
                    return
                else:
                    raise ConnectionError(f"unknown message type {op}")
        except (OSError, ConnectionError, IndexError, ValueError) as err:
            if peer >= 0 and not self._closing:
                with self._state:
                    self._failed.setdefault(peer, f"connection lost ({err})")
                    self._state.notify_all()
        finally:
            try:
                conn.close()
            except OSError:
                pass

    def _receive_add(self, conn: socket.socket, name: str, nbytes: int, offset: int, staging: torch.Tensor) -> None:
        dtype = self._specs[name].dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        view = _byte_view(staging)
        done = 0
        while done < nbytes:
            n = min(self._chunk_bytes, nbytes - done)
            _recv_exact(conn, view[:n])
            # Received outside the lock; only the add itself is serialised against other adders.
            self._add_fn(name, (offset + done) // itemsize, staging[:n].view(dtype))
            done += n

    def _locked_add(self, name: str, offset: int, src: torch.Tensor) -> None:
        with self._locks[name]:
            self._buffers[name][offset : offset + src.numel()].add_(src)

    # ------------------------------------------------------------- client side
    def _fail(self, peer: int, what: str, err: BaseException) -> ODCTimeoutError:
        """The error for a failed send/receive to ``peer``, naming every rank known to be dead."""
        with self._state:
            if not isinstance(err, socket.timeout):
                # Let the handler of the peer's own connection process what the peer sent last (an abort naming
                # the root cause, or a goodbye) before composing the message.
                self._state.wait_for(lambda: peer in self._failed or self._said_bye[peer], 1.0)
            self._failed.setdefault(peer, f"{what} failed ({err})")
            culprits = sorted(self._failed)
            causes = "; ".join(f"rank {p}: {self._failed[p]}" for p in culprits)
        if isinstance(err, socket.timeout):
            text = f"rank {self.rank}: {what} rank {peer} did not complete within {self.timeout:.1f}s"
        else:
            text = f"rank {self.rank}: {what} rank {peer} failed, the peer died or closed its transport ({err})"
        self._abort(culprits)
        return ODCTimeoutError(f"{text}. Known failures: {causes}; the optimizer step is lost", culprits)

    def _abort(self, culprits: list[int]) -> None:
        """Best effort: tell every live peer which ranks failed, before this rank gives up too."""
        for peer, conn in self._peers.items():
            if peer in culprits:
                continue
            for culprit in culprits:
                try:
                    with conn.lock:
                        conn.sock.sendall(_HEADER.pack(_ABORT, 0, culprit, 0))
                except OSError:
                    break

    def _peer(self, peer: int) -> _Peer:
        if self._closed:
            raise RuntimeError("the NetworkTransport is closed")
        try:
            return self._peers[peer]
        except KeyError:
            raise ValueError(f"rank {peer} is not a peer of rank {self.rank} (world size {self.world_size})") from None

    def read(self, peer: int, name: str, out: torch.Tensor) -> None:
        spec = self._specs[name]
        if out.numel() != spec.numel:
            raise ValueError(f"read of {name!r}: out has {out.numel()} elements, the buffer {spec.numel}")
        if peer == self.rank:
            out.copy_(self._buffers[name].view(out.shape))
            return
        direct = out.device.type == "cpu" and out.is_contiguous() and out.dtype == spec.dtype
        target = out if direct else torch.empty(spec.numel, dtype=spec.dtype)
        conn = self._peer(peer)
        with conn.lock:
            try:
                conn.sock.sendall(_HEADER.pack(_READ, self._index[name], 0, 0))
                _recv_exact(conn.sock, _byte_view(target))
            except (OSError, ConnectionError) as err:
                raise self._fail(peer, f"reading {name!r} from", err) from err
        if not direct:
            out.copy_(target.view(out.shape))

    def accumulate(self, owner: int, name: str, src: torch.Tensor) -> None:
        spec = self._specs[name]
        if src.numel() != spec.numel:
            raise ValueError(f"accumulate into {name!r}: src has {src.numel()} elements, the buffer {spec.numel}")
        if owner == self.rank:
            self._add_fn(name, 0, src.reshape(-1))
            return
        # The payload is in the kernel's socket buffer once sendall returns, so the caller may reuse src at once.
        payload = src.detach().to(device="cpu", dtype=spec.dtype).contiguous()
        conn = self._peer(owner)
        with conn.lock:
            try:
                _send_msg(conn.sock, _HEADER.pack(_ACC, self._index[name], spec.nbytes, 0), _byte_view(payload))
            except (OSError, ConnectionError) as err:
                raise self._fail(owner, f"adding into {name!r} of", err) from err

    # ---------------------------------------------------------------- claims
    has_claims = True

    def claim(self, round: int) -> int:
        """Fetch-and-add on rank 0's counter of ``round`` (see `Transport.claim`), applied by rank 0's service."""
        if not 0 < round < 2**31:
            raise ValueError(f"claim round must be in [1, 2**31), got {round}")
        if self.rank == 0:
            return self._claim_here(round)
        reply = bytearray(_CLAIM_REPLY.size)
        conn = self._peer(0)
        with conn.lock:
            try:
                conn.sock.sendall(_HEADER.pack(_CLAIM, 0, round, 0))
                _recv_exact(conn.sock, memoryview(reply))
            except (OSError, ConnectionError) as err:
                raise self._fail(0, "claiming a microbatch from", err) from err
        return _CLAIM_REPLY.unpack(reply)[0]

    def _claim_here(self, round: int) -> int:
        """Rank 0's side of `claim`: one lock serialises the service threads and the training thread."""
        with self._claim_lock:
            if round != self._claim_round:
                self._claim_round, self._claim_next = round, 0
            index = self._claim_next
            self._claim_next += 1
        return index

    # ------------------------------------------------------------ sync point
    def barrier(self) -> None:
        if self._closed:
            raise RuntimeError("the NetworkTransport is closed")
        # Two rounds. After round one, a rank's OWN buffers hold every add sent to it before the barrier (each
        # peer's adds precede its arrival on the same ordered connection), but a third rank may return from round
        # one before that owner has applied them. A round-two arrival is sent only once its sender's buffers are
        # complete, so after round two any rank may read any peer's buffer.
        deadline = time.monotonic() + self.timeout
        self._barrier_round(deadline)
        self._barrier_round(deadline)

    def _barrier_round(self, deadline: float) -> None:
        self._counter += 1
        target = self._counter
        for peer, conn in self._peers.items():
            with conn.lock:
                try:
                    conn.sock.sendall(_HEADER.pack(_ARRIVE, 0, target, 0))
                except (OSError, ConnectionError) as err:
                    with self._state:
                        if self._arrived[peer] >= target:
                            continue  # it arrived and then closed: it needs nothing more from us
                    raise self._fail(peer, f"barrier #{target}: signalling", err) from err

        with self._state:
            waiting = [p for p in self._peers if self._arrived[p] < target]
            while waiting:
                # A missing peer that died or said goodbye can never arrive: fail now, not at the timeout.
                gone = [p for p in waiting if p in self._failed or self._said_bye[p]]
                if gone:
                    gone = sorted(set(gone) | set(self._failed))
                    why = ", ".join(
                        f"rank {p} ({self._failed[p] if p in self._failed else 'closed its transport'})" for p in gone
                    )
                    error = ODCTimeoutError(
                        f"ODC barrier on rank {self.rank}: {why} before reaching barrier #{target}; "
                        "the optimizer step is lost",
                        gone,
                    )
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ODCTimeoutError(
                        f"ODC barrier on rank {self.rank} timed out after {self.timeout:.1f}s: rank(s) {waiting} "
                        f"did not arrive at barrier #{target}",
                        waiting,
                    )
                self._state.wait(left)
                waiting = [p for p in waiting if self._arrived[p] < target]
            else:
                return
        self._abort([p for p in gone if p in self._failed])
        raise error

    def _wait(self, pending: Callable[[], list[int]], deadline: float) -> list[int]:
        """Wait (holding ``_state``) until ``pending()`` is empty or the deadline passes; return what is left."""
        left = pending()
        while left and time.monotonic() < deadline:
            self._state.wait(deadline - time.monotonic())
            left = pending()
        return left

    # --------------------------------------------------------------- tear-down
    @staticmethod
    def _shutdown_sockets(listener: socket.socket, conns: list[socket.socket], peers: dict[int, _Peer]) -> None:
        for peer in peers.values():
            try:
                peer.sock.sendall(_HEADER.pack(_BYE, 0, 0, 0))
            except OSError:
                pass
        for sock in [listener, *conns, *(p.sock for p in peers.values())]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                sock.close()
            except OSError:
                pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._closing = True
        if self._finalizer is not None:
            self._finalizer()  # goodbyes, then every socket shut down: blocked threads return at once
        elif self._listener is not None:
            self._listener.close()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:  # pragma: no cover - a handler stuck in an add
            logger.warning("network transport threads still running after close: %s", alive)
        self._threads = []
        self._peers = {}
