"""Helpers to run real multi-process gloo jobs on CPU (tests and benchmarks).

:func:`launch` starts ``world_size`` fresh processes (``forkserver`` where the platform has it, else ``spawn``),
initialises a gloo process group on loopback in each, runs ``fn(rank, world_size, *args)`` and returns every rank's
result. A rank that raises, dies or overruns the timeout makes :func:`launch` raise with that rank's traceback; no
process is left behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


class LaunchError(RuntimeError):
    """One or more ranks failed; ``failures`` maps rank -> traceback text (or exit description)."""

    def __init__(self, failures: dict[int, str], results: dict[int, Any]) -> None:
        self.failures = failures
        self.results = results
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed:\n{text}")


# Imported once by the fork server; every rank is a fork of it, so a job starts without importing torch and the engine
# again (seconds per rank). The server creates no process group and no CUDA context; a fork copies only its main
# thread (after these imports the server has one helper thread of torch's, which no rank needs).
_PRELOAD = ["torch", "torch.distributed", "odc_accelerate.engine.engine"]


def _context(start_method: str | None) -> Any:
    if start_method not in (None, "forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', not {start_method!r}")
    if start_method == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (the first launch)
    return ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    threads: int,
    args: tuple,
    results,
    env: dict,
    parent_env: dict,
) -> None:
    # Before the process group exists: once gloo's threads run, a setenv racing their getenv is undefined behaviour.
    # A fork of the fork server starts with the server's environment: take the caller's, as a spawned rank would.
    for key in set(os.environ) - set(parent_env):
        del os.environ[key]
    os.environ.update(parent_env)
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def launch(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 300.0,
    threads: int = 1,
    allow_failures: bool = False,
    env: dict[str, str | None] | None = None,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; return results by rank.

    Args:
        fn: a module-level (picklable) function.
        world_size: number of processes.
        timeout: seconds for the whole job; stragglers are killed and reported.
        threads: torch threads per process (1 = one core per rank).
        allow_failures: return ``LaunchError.results``-style partial results instead of raising; failed
            ranks then hold ``LaunchError`` text in their slot.
        env: environment variables to set (a value of None removes the variable) in every rank before its process
            group is created. Each rank starts from this process's environment at the call, as with ``spawn``.
        start_method: ``"forkserver"`` (the default where the platform has it: ranks are forks of a server that has
            torch and the engine imported) or ``"spawn"`` (a fresh interpreter per rank: for what is read only when a
            process starts, such as glibc's ``MALLOC_*`` settings, or a measurement of a rank's whole memory).
    """
    ctx = _context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, r, world_size, port, threads, args, results, dict(env or {}), dict(os.environ)),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(got) + len(failures) < world_size:
        try:
            rank, ok, out = results.get(timeout=0.2)
            (got if ok else failures)[rank] = out
            continue
        except queue.Empty:
            pass
        # A rank that died without reporting (e.g. SIGKILL) is recorded once the queue is drained.
        for r, p in enumerate(procs):
            if r not in got and r not in failures and not p.is_alive():
                try:
                    rank, ok, out = results.get(timeout=0.5)
                    (got if ok else failures)[rank] = out
                except queue.Empty:
                    failures[r] = f"process exited with code {p.exitcode} without reporting"
        if time.monotonic() > deadline:
            for r in range(world_size):
                if r not in got and r not in failures:
                    failures[r] = f"did not finish within {timeout:.0f}s"
            break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    if failures and not allow_failures:
        raise LaunchError(failures, got)
    return [got.get(r, failures.get(r)) for r in range(world_size)]


def shm_files_of(pids: list[int]) -> list[str]:
    """ODC files in ``/dev/shm`` created by any of ``pids`` (the shared-memory transport puts the creator's pid in
    each file name)."""
    suffixes = tuple(f"_p{pid}.{ext}" for pid in pids for ext in ("seg", "lock"))
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("odc_") and f.endswith(suffixes))


def read_pids(pid_dir: str | os.PathLike) -> list[int]:
    """The pids that workers wrote to ``pid_dir/rank<r>.pid``."""
    from pathlib import Path

    return [int(p.read_text()) for p in sorted(Path(pid_dir).glob("rank*.pid"))]
