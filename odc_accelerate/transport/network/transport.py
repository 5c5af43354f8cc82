"""Network transport: one-sided reads and accumulates over TCP, served by a background thread on each owner.

This is the training thread's side, `NetworkTransport`: one persistent ``TCP_NODELAY`` connection per peer, tensor
bytes sent without copies, fire-and-forget adds (ordered per connection, so one barrier per step is enough), ``claim``
served by rank 0, and a barrier that names a peer whose connection closed without a goodbye. ``register`` is its only
``torch.distributed`` call (addresses and a job id). Protocol, address choice and wire format: docs/transports.md,
"Protocol details".
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..base import BufferSpec, ODCTimeoutError, Transport
from .service import DEFAULT_CHUNK_BYTES, AddFn, NetworkService
from .wire import (
    ABORT,
    ACCUMULATE,
    ARRIVE,
    CLAIM,
    CLAIM_REPLY,
    HEADER,
    HELLO,
    JOB_BYTES,
    READ,
    byte_view,
    default_address,
    recv_exact,
    send_msg,
)

logger = logging.getLogger(__name__)


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
    devices = ("cpu",)
    spans_hosts = True
    adds_atomically = True  # the owner's service applies adds under a per-buffer lock

    @classmethod
    def fits_hosts(cls, ranks_per_host: Sequence[int]) -> bool:
        """One rank per host: hosts with several ranks are ``"hierarchical"``'s (shared memory within them)."""
        return max(ranks_per_host) == 1

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
        self._service = NetworkService(rank, world_size, self.timeout, chunk_bytes)
        # Written by the service's handler threads, read here, under ``changed``.
        self._status = self._service.status
        self._group = group
        self._address = address
        self._peers: dict[int, _Peer] = {}
        self._counter = 0
        self._closed = False
        self.endpoints: list[tuple[str, int]] = []

    @property
    def job_id(self) -> str | None:
        return self._status.job_id

    # ------------------------------------------------------------------ set-up
    def register(self, specs: Mapping[str, BufferSpec]) -> dict[str, torch.Tensor]:
        buffers = {name: torch.zeros(spec.numel, dtype=spec.dtype) for name, spec in specs.items()}
        self.serve(specs, buffers)
        return dict(buffers)

    def serve(
        self, specs: Mapping[str, BufferSpec], buffers: Mapping[str, torch.Tensor], *, add: AddFn | None = None
    ) -> None:
        """Collective: ``register`` for buffers the caller owns. Serve ``buffers`` (this rank's memory for ``specs``)
        to the peers and connect to theirs.

        For composite transports whose buffers live elsewhere (e.g. shared memory) and need their own locking: ``add``
        (called as ``add(name, offset, src)``) then replaces the default add under a per-buffer lock, for peers' adds
        and this rank's own.
        """
        if self._service.listening or self._closed:
            raise RuntimeError("NetworkTransport.register may be called only once")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("NetworkTransport.register needs an initialised torch.distributed process group")
        address = self._address or default_address()
        port = self._service.serve(specs, buffers, address=address, add=add)

        spec_list = [(name, spec.numel, str(spec.dtype)) for name, spec in specs.items()]
        info = {
            "job": uuid.uuid4().hex[:JOB_BYTES] if self.rank == 0 else None,
            "address": address,
            "port": port,
            "specs": spec_list,
        }
        infos: list[dict] = [None] * self.world_size  # type: ignore[list-item]
        dist.all_gather_object(infos, info, group=self._group)
        bad = [r for r, i in enumerate(infos) if i["specs"] != spec_list]
        if bad:
            raise ValueError(f"ranks {bad} registered different buffers than rank {self.rank}: models differ")
        with self._status.changed:
            self._status.job_id = infos[0]["job"]
            self._status.changed.notify_all()  # handlers of early peers wait for it to check their hello
        self.endpoints = [(i["address"], i["port"]) for i in infos]
        deadline = time.monotonic() + self.timeout
        for peer in range(self.world_size):
            if peer != self.rank:
                self._peers[peer] = self._connect(peer, deadline)
        self._service.set_outgoing({peer: conn.sock for peer, conn in self._peers.items()})
        # Every peer has connected to us too before we return, so that a crash is noticed from now on.
        with self._status.changed:
            missing = self._wait(lambda: [p for p in self._peers if p not in self._status.connected], deadline)
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
            sock.sendall(HEADER.pack(HELLO, 0, self.rank, 0) + self.job_id.encode().ljust(JOB_BYTES))
            reply = bytearray(1)
            recv_exact(sock, memoryview(reply))
        except (OSError, ConnectionError) as err:
            sock.close()
            raise ODCTimeoutError(f"rank {peer} refused rank {self.rank}'s connection: {err}", [peer]) from err
        return _Peer(sock)

    # ------------------------------------------------------------- failures
    def _fail(self, peer: int, what: str, err: BaseException) -> ODCTimeoutError:
        """The error for a failed send/receive to ``peer``, naming every rank known to be dead."""
        status = self._status
        with status.changed:
            if not isinstance(err, socket.timeout):
                # Let the handler of the peer's own connection process what the peer sent last (an abort naming
                # the root cause, or a goodbye) before composing the message.
                status.changed.wait_for(lambda: peer in status.failed or status.said_bye[peer], 1.0)
            status.failed.setdefault(peer, f"{what} failed ({err})")
            culprits = sorted(status.failed)
            causes = "; ".join(f"rank {p}: {status.failed[p]}" for p in culprits)
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
                        conn.sock.sendall(HEADER.pack(ABORT, 0, culprit, 0))
                except OSError:
                    break

    def _peer(self, peer: int) -> _Peer:
        if self._closed:
            raise RuntimeError("the NetworkTransport is closed")
        try:
            return self._peers[peer]
        except KeyError:
            raise ValueError(f"rank {peer} is not a peer of rank {self.rank} (world size {self.world_size})") from None

    # ------------------------------------------------------------- data path
    def read(self, peer: int, name: str, out: torch.Tensor) -> None:
        spec = self._service.specs[name]
        if out.numel() != spec.numel:
            raise ValueError(f"read of {name!r}: out has {out.numel()} elements, the buffer {spec.numel}")
        if peer == self.rank:
            out.copy_(self._service.buffers[name].view(out.shape))
            return
        direct = out.device.type == "cpu" and out.is_contiguous() and out.dtype == spec.dtype
        target = out if direct else torch.empty(spec.numel, dtype=spec.dtype)
        conn = self._peer(peer)
        with conn.lock:
            try:
                conn.sock.sendall(HEADER.pack(READ, self._service.index[name], 0, 0))
                recv_exact(conn.sock, byte_view(target))
            except (OSError, ConnectionError) as err:
                raise self._fail(peer, f"reading {name!r} from", err) from err
        if not direct:
            out.copy_(target.view(out.shape))

    def accumulate(self, owner: int, name: str, src: torch.Tensor) -> None:
        spec = self._service.specs[name]
        if src.numel() != spec.numel:
            raise ValueError(f"accumulate into {name!r}: src has {src.numel()} elements, the buffer {spec.numel}")
        if owner == self.rank:
            self._service.add(name, 0, src.reshape(-1))
            return
        # The payload is in the kernel's socket buffer once sendall returns, so the caller may reuse src at once.
        payload = src.detach().to(device="cpu", dtype=spec.dtype).contiguous()
        conn = self._peer(owner)
        with conn.lock:
            try:
                header = HEADER.pack(ACCUMULATE, self._service.index[name], spec.nbytes, 0)
                send_msg(conn.sock, header, byte_view(payload))
            except (OSError, ConnectionError) as err:
                raise self._fail(owner, f"adding into {name!r} of", err) from err

    # ---------------------------------------------------------------- claims
    has_claims = True

    def claim(self, round: int) -> int:
        """Fetch-and-add on rank 0's counter of ``round`` (see `Transport.claim`), applied by rank 0's service."""
        if not 0 < round < 2**31:
            raise ValueError(f"claim round must be in [1, 2**31), got {round}")
        if self.rank == 0:
            return self._service.claim(round)
        reply = bytearray(CLAIM_REPLY.size)
        conn = self._peer(0)
        with conn.lock:
            try:
                conn.sock.sendall(HEADER.pack(CLAIM, 0, round, 0))
                recv_exact(conn.sock, memoryview(reply))
            except (OSError, ConnectionError) as err:
                raise self._fail(0, "claiming a microbatch from", err) from err
        return CLAIM_REPLY.unpack(reply)[0]

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
        status = self._status
        self._counter += 1
        target = self._counter
        for peer, conn in self._peers.items():
            with conn.lock:
                try:
                    conn.sock.sendall(HEADER.pack(ARRIVE, 0, target, 0))
                except (OSError, ConnectionError) as err:
                    with status.changed:
                        if status.arrived[peer] >= target:
                            continue  # it arrived and then closed: it needs nothing more from us
                    raise self._fail(peer, f"barrier #{target}: signalling", err) from err

        with status.changed:
            waiting = [p for p in self._peers if status.arrived[p] < target]
            while waiting:
                # A missing peer that died or said goodbye can never arrive: fail now, not at the timeout.
                gone = [p for p in waiting if p in status.failed or status.said_bye[p]]
                if gone:
                    gone = sorted(set(gone) | set(status.failed))
                    why = ", ".join(
                        f"rank {p} ({status.failed[p] if p in status.failed else 'closed its transport'})"
                        for p in gone
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
                status.changed.wait(left)
                waiting = [p for p in waiting if status.arrived[p] < target]
            else:
                return
        self._abort([p for p in gone if p in status.failed])
        raise error

    def _wait(self, pending: Callable[[], list[int]], deadline: float) -> list[int]:
        """Wait (holding the status' ``changed``) until ``pending()`` is empty or the deadline passes; return what is
        left."""
        left = pending()
        while left and time.monotonic() < deadline:
            self._status.changed.wait(deadline - time.monotonic())
            left = pending()
        return left

    # --------------------------------------------------------------- tear-down
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._service.shutdown()
        self._peers = {}
