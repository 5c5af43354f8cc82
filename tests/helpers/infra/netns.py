"""Run a multi-host gloo job on one Linux machine: every "host" is its own network, UTS and mount namespace.

:class:`VirtualHosts` creates ``n`` network namespaces wired to a private bridge (itself in a namespace, so the
machine's own network is never touched), each with a veth interface and a ``10.x.y.(i+1)`` address. A host's ranks
run under ``ip netns exec <ns> unshare --uts --mount``: their own host name and their own empty ``/dev/shm``
(ranks of one host share it, ranks of different hosts cannot), so nothing but the veth links connects the hosts.
gloo and ODC's network transport both go through the veths (``MASTER_ADDR`` is host 0's address,
``GLOO_SOCKET_IFNAME`` the host's veth).

Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN), ``ip`` and ``unshare``; :func:`netns_unavailable_reason` says what is
missing. Namespaces and links are removed on exit, and stale ones from a killed run at the next start.

Usage (the function must be importable by module path)::

    with VirtualHosts(2) as hosts:
        results = hosts.run([2, 2], train, spec, timeout=240)  # 2 hosts x 2 ranks
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

_PREFIX = "odcvh"
_PORT = 29533
_MODULE = "tests.helpers.infra.netns"  # not __name__, which is "__main__" inside the hosts


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def netns_unavailable_reason() -> str | None:
    """Why :class:`VirtualHosts` cannot run here, or None when it can (tries creating a namespace)."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, this is {sys.platform}"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    name = f"{_PREFIX}{os.getpid()}probe"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as err:
        detail = getattr(err, "stderr", "") or str(err)
        return f"'ip netns add' failed: {detail.strip()}"
    finally:
        _ip("netns", "del", name, check=False)
    return None


def _cleanup_stale() -> None:
    """Delete namespaces left by runs whose creating process no longer exists."""
    listing = _ip("netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(_PREFIX):
            continue
        digits = "".join(ch for ch in name[len(_PREFIX) :].split("x")[0] if ch.isdigit())
        if digits and not os.path.exists(f"/proc/{digits}"):
            _ip("netns", "del", name, check=False)


class VirtualHosts:
    """``n`` isolated "hosts" (network namespaces on a private bridge) that can run gloo jobs together.

    Args:
        n (`int`): number of hosts.
    """

    def __init__(self, n: int) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"n must be in [1, 200], got {n}")
        self.n = n
        tag = f"{os.getpid()}x{random.randrange(16**4):04x}"
        self.switch = f"{_PREFIX}{tag}s"
        self.namespaces = [f"{_PREFIX}{tag}h{i}" for i in range(n)]
        self.interfaces = [f"odc{i}" for i in range(n)]
        self.subnet = f"10.{random.randrange(100, 250)}.{random.randrange(1, 250)}"
        self.addresses = [f"{self.subnet}.{i + 1}" for i in range(n)]
        self._created: list[str] = []

    def __enter__(self) -> VirtualHosts:
        _cleanup_stale()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        _ip("netns", "add", self.switch)
        self._created.append(self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        for i, ns in enumerate(self.namespaces):
            _ip("netns", "add", ns)
            self._created.append(ns)
            # Both ends are born in the switch namespace, so the machine's own namespace never sees them.
            _ip("link", "add", f"p{i}", "type", "veth", "peer", "name", self.interfaces[i], ns=self.switch)
            _ip("link", "set", self.interfaces[i], "netns", ns, ns=self.switch)
            _ip("link", "set", f"p{i}", "master", "br0", ns=self.switch)
            _ip("link", "set", f"p{i}", "up", ns=self.switch)
            _ip("addr", "add", f"{self.addresses[i]}/24", "dev", self.interfaces[i], ns=ns)
            _ip("link", "set", self.interfaces[i], "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)

    def close(self) -> None:
        """Delete every namespace (their veths go with them); idempotent."""
        for ns in reversed(self._created):
            _ip("netns", "del", ns, check=False)
        self._created = []

    def run(
        self,
        ranks_per_host: Sequence[int],
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = 300.0,
        threads: int = 1,
        allow_failures: bool = False,
    ) -> list[dict[str, Any]]:
        """Run ``fn(rank, world_size, *args)`` on every rank; ranks are numbered host by host.

        Returns, per rank, ``{"ok": bool, "value": result or traceback text, "logs": [ODC transport log lines]}``.
        Raises RuntimeError if a rank fails (unless ``allow_failures``) or the job overruns ``timeout``.
        """
        if len(ranks_per_host) > self.n:
            raise ValueError(f"{len(ranks_per_host)} hosts requested, {self.n} created")
        world = sum(ranks_per_host)
        workdir = tempfile.mkdtemp(prefix="odc_vhosts_")
        job = os.path.join(workdir, "job.pkl")
        with open(job, "wb") as f:
            pickle.dump({"fn": fn, "args": args, "threads": threads}, f)
        procs = []
        first = 0
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_repo_root(), os.environ.get("PYTHONPATH")])))
        try:
            for host, count in enumerate(ranks_per_host):
                ranks = ",".join(str(r) for r in range(first, first + count))
                first += count
                cmd = [
                    "ip", "netns", "exec", self.namespaces[host],
                    "unshare", "--uts", "--mount", "--propagation", "private",
                    sys.executable, "-m", _MODULE, "host", job, str(world), ranks,
                    self.addresses[0], self.interfaces[host], f"vhost{host}",
                ]  # fmt: skip
                procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
            deadline = time.monotonic() + timeout
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break
            results = []
            for rank in range(world):
                path = os.path.join(workdir, f"rank{rank}.pkl")
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        results.append(pickle.load(f))
                else:
                    results.append({"ok": False, "value": "rank exited or timed out without a result", "logs": []})
        finally:
            for proc in procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait()
            shutil.rmtree(workdir, ignore_errors=True)
        failed = {r: res["value"] for r, res in enumerate(results) if not res["ok"]}
        if failed and not allow_failures:
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failed.items())
            raise RuntimeError(f"{len(failed)} rank(s) failed on virtual hosts:\n{text}")
        return results


def _repo_root() -> str:
    here = os.path.dirname(os.path.abspath(__file__))  # tests/helpers/infra
    return os.path.dirname(os.path.dirname(os.path.dirname(here)))


# ---------------------------------------------------------------------------------------------- inside the hosts
def _host_main(job: str, world: str, ranks: str, master: str, iface: str, hostname: str) -> int:
    """One host: private /dev/shm and host name, then one process per rank (they inherit both)."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "odcshm", "/dev/shm"], check=True)
    import socket

    socket.sethostname(hostname)
    env = dict(os.environ, MASTER_ADDR=master, MASTER_PORT=str(_PORT), WORLD_SIZE=world, GLOO_SOCKET_IFNAME=iface)
    procs = [
        subprocess.Popen([sys.executable, "-m", _MODULE, "rank", job, rank], env=dict(env, RANK=rank))
        for rank in ranks.split(",")
    ]
    return max(p.wait() for p in procs)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


def _rank_main(job: str, rank: str) -> int:
    import torch
    import torch.distributed as dist

    with open(job, "rb") as f:
        spec = pickle.load(f)
    torch.set_num_threads(spec["threads"])
    collect = _Collect()
    odc_logger = logging.getLogger("odc_accelerate")
    odc_logger.addHandler(collect)
    odc_logger.setLevel(logging.INFO)
    r, world = int(rank), int(os.environ["WORLD_SIZE"])
    out = {"ok": False, "value": None, "logs": collect.lines}
    try:
        dist.init_process_group("gloo", rank=r, world_size=world)
        out["value"] = spec["fn"](r, world, *spec["args"])
        out["ok"] = True
    except BaseException:
        out["value"] = traceback.format_exc()
    finally:
        with open(os.path.join(os.path.dirname(job), f"rank{rank}.pkl.tmp"), "wb") as f:
            pickle.dump(out, f)
        os.replace(
            os.path.join(os.path.dirname(job), f"rank{rank}.pkl.tmp"),
            os.path.join(os.path.dirname(job), f"rank{rank}.pkl"),
        )
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    return 0 if out["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    host = sub.add_parser("host")
    for arg in ("job", "world", "ranks", "master", "iface", "hostname"):
        host.add_argument(arg)
    rank = sub.add_parser("rank")
    rank.add_argument("job")
    rank.add_argument("rank")
    args = parser.parse_args(argv)
    if args.what == "host":
        return _host_main(args.job, args.world, args.ranks, args.master, args.iface, args.hostname)
    return _rank_main(args.job, args.rank)


if __name__ == "__main__":
    sys.exit(main())


def train_as_host(rank: int, world_size: int, spec: dict[str, Any], host_ids: Sequence[str] | None = None) -> Any:
    """:func:`~tests.helpers.workers.engine_workers.train` with ``ODC_HOST_ID`` set to ``host_ids[rank]``.

    The fallback when namespaces are unavailable: ranks of one machine that claim distinct hosts. Returns
    ``{"value": train's result, "logs": ODC transport log lines}`` like :meth:`VirtualHosts.run`.
    """
    from tests.helpers.workers.engine_workers import train

    if host_ids is not None:
        os.environ["ODC_HOST_ID"] = host_ids[rank]
    collect = _Collect()
    odc_logger = logging.getLogger("odc_accelerate")
    odc_logger.addHandler(collect)
    odc_logger.setLevel(logging.INFO)
    try:
        return {"ok": True, "value": train(rank, world_size, spec), "logs": collect.lines}
    finally:
        odc_logger.removeHandler(collect)
