"""Shared-memory transport for ranks on one host (CPU tensors).

Each rank owns a segment file in ``/dev/shm`` (a control header, then its buffers) and a lock file; every rank maps
every peer's segment. ``read`` copies out of the mapping, ``accumulate`` adds in place under a POSIX record lock,
``barrier`` polls the peers' counters and checks they are alive. The file names exist only during ``register``
(:func:`cleanup_stale_segments` removes those of a rank killed there). File lifetime, locking and store ordering:
docs/transports.md, "Shared-memory files" and "Protocol details".
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import time
import uuid
import weakref
from collections.abc import Mapping

import torch
import torch.distributed as dist

from .base import BufferSpec, ODCTimeoutError, Transport, host_id

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "odc_"
_ALIGN = 64
_HEADER_BYTES = 64  # int64 x 8: [0] barrier, [1] pid, [2] start time, [3] set-up flag, [4] claims, [5] closed, rest
_BARRIER, _SETUP = 0, 3  # header slots that peers poll
_CLOSED = 5  # 1 once the rank closed its transport: a peer waiting for it in a barrier stops at once
_CLAIM = 4  # rank 0's claim word: ``round << 32 | next index`` (one aligned 8-byte store)
_CLAIM_LOCK_BYTE = 1 << 30  # the byte of rank 0's lock file that guards the claim word (buffers use 0, 1, 2, ...)
_NAME_RE = re.compile(r"^odc_(?P<job>[0-9a-f]+)_r(?P<rank>\d+)_p(?P<pid>\d+)\.(?:seg|lock)$")


def _proc_start_time(pid: int) -> int | None:
    """Kernel start time of ``pid`` (clock ticks since boot), or None if it does not run.

    Zombies count as dead: a killed child that its launcher has not reaped yet still answers
    ``kill(pid, 0)``.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _pid_matches(pid: int, start_time: int) -> bool:
    """True while the process that created a segment still runs (pid reuse is told apart)."""
    return _proc_start_time(pid) == start_time


def _unlink_quietly(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as err:  # pragma: no cover - only on odd filesystems
            logger.warning("could not remove %s: %s", path, err)


def cleanup_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove ODC segment files left by processes of this user that no longer run.

    Files have names only while the ranks set up (see the module docstring). Called at every transport start, so the
    files of a process killed during that window are removed by the next start on this host.

    Returns:
        `list[str]`: the removed paths.
    """
    removed = []
    uid = os.getuid()
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        match = _NAME_RE.match(name)
        if match is None:
            continue
        path = os.path.join(shm_dir, name)
        try:
            if os.stat(path).st_uid != uid:
                continue
        except OSError:
            continue
        if _proc_start_time(int(match["pid"])) is None:
            _unlink_quietly([path])
            removed.append(path)
    if removed:
        logger.info("removed %d stale ODC shared-memory file(s)", len(removed))
    return removed


def _layout(specs: Mapping[str, BufferSpec]) -> tuple[dict[str, tuple[int, int, BufferSpec]], int]:
    """Byte offsets of each buffer (in the given order) and the total segment size."""
    offsets: dict[str, tuple[int, int, BufferSpec]] = {}
    offset = _HEADER_BYTES
    for index, (name, spec) in enumerate(specs.items()):
        offsets[name] = (index, offset, spec)
        offset += -(-max(spec.nbytes, 1) // _ALIGN) * _ALIGN
    return offsets, offset


class ShmTransport(Transport):
    """One-sided reads and locked adds through ``/dev/shm`` for ranks on one host.

    Args:
        rank (`int`): this rank.
        world_size (`int`): number of ranks.
        timeout (`float`): seconds a barrier or a lock may wait.
        group (`torch.distributed.ProcessGroup`, *optional*): used only inside ``register`` to agree
            on a job id and check that all ranks share the host. Defaults to the world group.
        shm_dir (`str`, *optional*, defaults to `"/dev/shm"`): where segments live.
    """

    name = "shm"
    devices = ("cpu",)
    adds_atomically = True  # under a record lock per (owner, buffer)

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout: float = 600.0,
        group: dist.ProcessGroup | None = None,
        shm_dir: str = SHM_DIR,
    ) -> None:
        super().__init__(rank, world_size, timeout)
        self._group = group
        self._shm_dir = shm_dir
        self._paths: list[str] = []
        self._finalizer: weakref.finalize | None = None
        self._segments: list[torch.Tensor] = []
        self._headers: list[torch.Tensor] = []
        self._views: list[dict[str, torch.Tensor]] = []
        self._lock_index: dict[str, int] = {}
        self._lock_fds: list[int] = []
        self._peer_paths: list[list[str]] = []
        self._peer_ids: list[tuple[int, int]] = []
        self._counter = 0
        self._closed = False
        self.job_id: str | None = None

    # ------------------------------------------------------------------ set-up
    def register(self, specs: Mapping[str, BufferSpec]) -> dict[str, torch.Tensor]:
        if self._segments:
            raise RuntimeError("ShmTransport.register may be called only once")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ShmTransport.register needs an initialised torch.distributed process group")
        cleanup_stale_segments(self._shm_dir)
        my_pid = os.getpid()
        my_start = _proc_start_time(my_pid)
        spec_list = [(name, spec.numel, str(spec.dtype)) for name, spec in specs.items()]
        info = {
            "job": uuid.uuid4().hex[:16] if self.rank == 0 else None,
            "host": host_id(),
            "pid": my_pid,
            "start": my_start,
            "specs": spec_list,
        }
        infos: list[dict] = [None] * self.world_size  # type: ignore[list-item]
        dist.all_gather_object(infos, info, group=self._group)
        hosts = {i["host"] for i in infos}
        if len(hosts) != 1:
            raise ValueError(
                f"the shared-memory transport needs every rank on one host, but ranks run on {sorted(hosts)}; "
                "use a network transport for multi-host jobs"
            )
        bad = [r for r, i in enumerate(infos) if i["specs"] != spec_list]
        if bad:
            raise ValueError(f"ranks {bad} registered different buffers than rank {self.rank}: models differ")
        self.job_id = infos[0]["job"]
        self._peer_ids = [(i["pid"], i["start"]) for i in infos]
        self._peer_paths = [self._paths_for(r, i["pid"]) for r, i in enumerate(infos)]

        layout, total = _layout(specs)
        self._lock_index = {name: index for name, (index, _, _) in layout.items()}
        seg_path, lock_path = self._peer_paths[self.rank]
        self._paths = [seg_path, lock_path]
        # Until the names are unlinked below, our files go whatever happens to this object (close, GC, exit).
        self._finalizer = weakref.finalize(self, _unlink_quietly, list(self._paths))
        try:
            for path, size in ((seg_path, total), (lock_path, 0)):
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, size)
                finally:
                    os.close(fd)
            own = torch.from_file(seg_path, shared=True, size=total, dtype=torch.uint8)
            header = own[:_HEADER_BYTES].view(torch.int64)
            header[1] = my_pid
            header[2] = my_start
            # Every rank's files exist after this point; this is the last collective the transport makes.
            dist.barrier(group=self._group)

            for peer in range(self.world_size):
                seg = own if peer == self.rank else self._map(peer, total)
                self._segments.append(seg)
                self._headers.append(seg[:_HEADER_BYTES].view(torch.int64))
                self._views.append(
                    {name: seg[off : off + spec.nbytes].view(spec.dtype) for name, (_, off, spec) in layout.items()}
                )
                self._lock_fds.append(os.open(self._peer_paths[peer][1], os.O_RDWR))
            # Through the mapped headers, not a collective: a peer that dies here is named at once, and its files
            # (which it can no longer unlink) are removed.
            self._meet(_SETUP, 1, "the end of set-up", consequence="")
        except BaseException:
            self._finalizer()  # a failed set-up leaves nothing behind, whether or not the caller closes us
            raise
        # Every rank has mapped every segment and opened every lock file, so no name is needed any more. Each rank
        # unlinks all of them (not only its own), so that the names are gone as soon as any rank gets here.
        self._finalizer()
        for paths in self._peer_paths:
            _unlink_quietly(paths)
        logger.info(
            "shm transport up: job %s, rank %d/%d, %.1f MiB per rank",
            self.job_id,
            self.rank,
            self.world_size,
            total / 2**20,
        )
        return dict(self._views[self.rank])

    def _paths_for(self, rank: int, pid: int) -> list[str]:
        stem = os.path.join(self._shm_dir, f"{PREFIX}{self.job_id}_r{rank}_p{pid}")
        return [stem + ".seg", stem + ".lock"]

    def _map(self, peer: int, total: int) -> torch.Tensor:
        path = self._peer_paths[peer][0]
        size = os.stat(path).st_size
        if size != total:
            raise RuntimeError(f"rank {peer}'s segment {path} has {size} bytes, expected {total}")
        return torch.from_file(path, shared=True, size=total, dtype=torch.uint8)

    # ------------------------------------------------------------- data path
    def read(self, peer: int, name: str, out: torch.Tensor) -> None:
        out.copy_(self._views[peer][name])

    def accumulate(self, owner: int, name: str, src: torch.Tensor, offset: int = 0) -> None:
        """``owner.name[offset : offset + src.numel()] += src`` under the buffer's record lock."""
        dst = self._views[owner][name]
        if offset or src.numel() != dst.numel():
            dst = dst[offset : offset + src.numel()]
        fd, index = self._lock_fds[owner], self._lock_index[name]
        self._lock(fd, index, owner, name)
        try:
            dst.add_(src)
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, index)

    def _lock(self, fd: int, index: int, owner: int, name: str) -> None:
        # Non-blocking tries with backoff when contended (a blocking lock could not honour the timeout). The
        # kernel drops a dead holder's lock, so only a holder that hangs while adding can exhaust the timeout.
        deadline = time.monotonic() + self.timeout
        pause = 2e-5
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, index)
                return
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            time.sleep(pause)
            if time.monotonic() > deadline:
                raise ODCTimeoutError(
                    f"rank {self.rank} waited {self.timeout:.0f}s for the lock on rank {owner}'s buffer {name!r}",
                    [owner],
                )
            pause = min(pause * 2, 1e-3)

    # ---------------------------------------------------------------- claims
    has_claims = True

    def claim(self, round: int) -> int:
        """Fetch-and-add on rank 0's claim word (see `Transport.claim`).

        A real atomic, not a lock-free guess: every claimer takes the same exclusive POSIX record lock (the kernel
        arbitrates, across processes) before it reads and writes the word, and the lock and unlock system calls
        order memory, so each claim sees the word the previous holder wrote. The word holds the round and the next
        index together, written with one aligned 8-byte store, so a claimer killed while holding the lock (the kernel
        then releases it) leaves either the old word or the new one, never half of each.
        """
        if not 0 < round < 2**31:
            raise ValueError(f"claim round must be in [1, 2**31), got {round}")
        fd = self._lock_fds[0]
        self._lock(fd, _CLAIM_LOCK_BYTE, 0, "claim counter")
        try:
            word = self._headers[0][_CLAIM]
            current = int(word)
            index = current & 0xFFFFFFFF if current >> 32 == round else 0
            word.fill_((round << 32) | (index + 1))
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, _CLAIM_LOCK_BYTE)
        return index

    # ------------------------------------------------------------ sync point
    def barrier(self) -> None:
        self._counter += 1
        self._meet(_BARRIER, self._counter, f"barrier #{self._counter}", consequence="; the optimizer step is lost")

    def _meet(self, slot: int, target: int, what: str, consequence: str) -> None:
        """Set header ``slot`` to ``target`` and wait until every peer's is at least ``target`` (see ``barrier``)."""
        self._headers[self.rank][slot] = target
        peers = [p for p in range(self.world_size) if p != self.rank]
        deadline = time.monotonic() + self.timeout
        next_liveness = time.monotonic() + 0.05
        spins = 0
        while True:
            missing = [p for p in peers if int(self._headers[p][slot]) < target]
            if not missing:
                return
            now = time.monotonic()
            if now >= next_liveness:
                # A peer that closed its transport before arriving (it stopped with an error, e.g. a refusal during
                # the engine's set-up) will not come: say so now rather than at the timeout.
                closed = [p for p in missing if int(self._headers[p][_CLOSED])]
                if closed:
                    pids = ", ".join(f"rank {p} (pid {self._peer_ids[p][0]})" for p in closed)
                    raise ODCTimeoutError(
                        f"ODC barrier on rank {self.rank}: {pids} closed its transport before reaching {what} (it "
                        f"stopped with an error: see its own){consequence}",
                        closed,
                    )
                dead = [p for p in missing if not _pid_matches(*self._peer_ids[p])]
                if dead:
                    # Only a peer that died during set-up can still have names (after it every name is unlinked).
                    if slot == _SETUP:
                        self._remove_peer_files(dead)
                    pids = ", ".join(f"rank {p} (pid {self._peer_ids[p][0]})" for p in dead)
                    raise ODCTimeoutError(
                        f"ODC barrier on rank {self.rank}: {pids} exited before reaching {what}{consequence}",
                        dead,
                    )
                next_liveness = now + 0.05
            if now >= deadline:
                raise ODCTimeoutError(
                    f"ODC barrier on rank {self.rank} timed out after {self.timeout:.1f}s: rank(s) {missing} "
                    f"did not arrive at {what}",
                    missing,
                )
            # Spin briefly (barriers of balanced ranks meet within microseconds), then back off so a
            # waiting rank does not steal a core from a peer that shares it.
            spins += 1
            if spins < 200:
                os.sched_yield()
            else:
                time.sleep(min(1e-3, 1e-5 * (spins - 199)))

    def dead_peers(self) -> list[int]:
        """The peers whose processes no longer run (pid and start time checked; empty before ``register``)."""
        return [p for p, ids in enumerate(self._peer_ids) if p != self.rank and not _pid_matches(*ids)]

    def _remove_peer_files(self, peers: list[int]) -> None:
        for peer in peers:
            _unlink_quietly(self._peer_paths[peer])

    # --------------------------------------------------------------- tear-down
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._headers:
            self._headers[self.rank][_CLOSED] = 1
        for fd in self._lock_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._lock_fds = []
        # The names went at the end of register (or when it raised): dropping the mappings and descriptors is all
        # that is left, and the kernel frees the memory once no rank holds it.
        self._views, self._headers, self._segments = [], [], []
