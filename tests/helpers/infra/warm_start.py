"""Warm start for the processes the integration tests launch: a server that has the heavy libraries imported, and
forks once per Python process started with `env` (see ``warm_start_site/sitecustomize.py``, the client side).

Every rank, launcher and one-process reference of an integration test is a fresh interpreter that imports torch,
transformers, TRL, accelerate and datasets: ~9 s of CPU each, ~175 times in a session on 2 cores, and most of the
suite's time. A fork of this server skips those imports (as `odc_accelerate.testing.launch`'s forkserver does
for the engine tests); it still runs the command's own script or module from the start, with the command's
environment, working directory, arguments and standard streams, under the real launcher, and the process the
launcher watches keeps its pid, signals and exit status. odc_accelerate itself is not imported in advance: each
fork imports it afresh.

What differs from a fresh interpreter, and is tested with fresh ones elsewhere (`test_engine_exit.py` for the
interpreter's exit, the install tests, the CLI tests, Ctrl-C of a launcher): a fork exits after its ``atexit``
handlers without tearing down the interpreter (that teardown is ~2 s of CPU after importing TRL), its parent is not
the launcher, and it shares the server's hash seed. A command the server cannot run as a fresh interpreter would
(another interpreter, other interpreter options, descriptors other than the standard streams, an environment that
differs in anything read at import) starts as usual; `Server.entries` lists them, and the session's summary says
how many forked.

    python tests/helpers/infra/warm_start.py SOCKET LOG    # serve until the parent process exits
"""

from __future__ import annotations

import atexit
import builtins
import gc
import importlib
import importlib.machinery
import io
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

SITE = Path(__file__).resolve().parent / "warm_start_site"
IMPORTS = (
    "torch",
    "torch.distributed.fsdp",
    "numpy",
    "datasets",
    "accelerate",
    "accelerate.commands.launch",
    "transformers",
    "transformers.trainer",
    "trl",
    "trl.trainer.sft_trainer",
    "trl.trainer.dpo_trainer",
    "trl.trainer.grpo_trainer",
    "peft",
)
# Read after start-up (when a process group, accelerate's state or a trainer is created), so they may differ between
# the server and a command: launchers set them per job or per rank.
_PER_PROCESS = {
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONUNBUFFERED", "PWD", "OLDPWD", "_",
    "PYTEST_CURRENT_TEST",
}  # fmt: skip
# TORCH_SYMM_MEM_*: read when symmetric memory is set up (CUDA), which odc_accelerate's launcher configures per job.
_PER_PROCESS_PREFIXES = (
    "ODC_", "ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_", "TORCHELASTIC_", "TORCH_NCCL_", "NCCL_", "TORCH_SYMM_MEM_",
)  # fmt: skip


# The server's environment before its imports (which may set variables: torch sets TORCHINDUCTOR_CACHE_DIR).
_START_ENV = dict(os.environ)


def _import_env(env: dict[str, str]) -> dict[str, str]:
    """The part of ``env`` that start-up and imports may read."""
    return {k: v for k, v in env.items() if k not in _PER_PROCESS and not k.startswith(_PER_PROCESS_PREFIXES)}


def _mismatch(command: dict) -> str | None:
    """Why a fork of this server would not start ``command`` as a fresh interpreter would; None if it would."""
    if command["executable"] != sys.executable:
        return f"interpreter {command['executable']}"
    ours, theirs = _import_env(_START_ENV), _import_env(command["env"])
    # A variable the server's imports set comes to a command from a parent that made the same imports.
    imported = _import_env(_set_by_imports())
    differ = sorted(
        k
        for k in ours.keys() | theirs.keys()
        if ours.get(k) != theirs.get(k) and not (k in imported and theirs.get(k) == imported[k])
    )
    return f"environment differs in {', '.join(differ)}" if differ else None


def _set_by_imports() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if _START_ENV.get(k) != v}


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        more = conn.recv(1 << 16)
        if not more:
            raise ConnectionError("the client closed the connection")
        data += more
    return json.loads(data[4 : 4 + struct.unpack("!I", data[:4])[0]]), list(fds)


def _stream(fd: int, unbuffered: bool, like: io.TextIOWrapper) -> io.TextIOWrapper:
    """A standard stream on ``fd`` (0, 1 or 2) as a fresh interpreter makes it: with ``-u`` the output streams have
    no buffer; otherwise stderr is line-buffered, and stdout only on a terminal."""
    raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
    if fd == 0:
        buffered: io.RawIOBase | io.BufferedIOBase = io.BufferedReader(raw)
    else:
        buffered = raw if unbuffered else io.BufferedWriter(raw)
    line_buffering = not unbuffered and (fd == 2 or raw.isatty())
    return io.TextIOWrapper(
        buffered,
        encoding=like.encoding,
        errors=like.errors,
        line_buffering=line_buffering,
        write_through=unbuffered,
    )


def _run(command: dict, fds: list[int]) -> None:
    """Become ``command`` (in the fork) and exit with its status."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(command["cwd"])
    set_by_imports = _set_by_imports()
    os.environ.clear()
    os.environ.update(command["env"])
    os.environ.update(set_by_imports)  # as the command's own imports would have
    unbuffered = command["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = _stream(0, unbuffered, sys.__stdin__)
    sys.stdout = sys.__stdout__ = _stream(1, unbuffered, sys.__stdout__)
    sys.stderr = sys.__stderr__ = _stream(2, unbuffered, sys.__stderr__)
    if "numpy" in sys.modules:  # a fresh interpreter seeds numpy's global generator from the OS
        sys.modules["numpy"].random.seed()
    code = 0
    try:
        if "module" in command:
            sys.path[0] = os.getcwd()
            sys.argv = [command["module"], *command["args"]]
            import runpy

            runpy._run_module_as_main(command["module"], alter_argv=True)
        else:
            # As a fresh interpreter has it: sys.argv[0] as given, __file__ joined to the working directory,
            # sys.path[0] the directory of the script with its links resolved.
            path = os.path.join(os.getcwd(), command["script"])
            sys.path[0] = os.path.dirname(os.path.realpath(path))
            sys.argv = [command["script"], *command["args"]]
            main = types.ModuleType("__main__")
            main.__dict__.update(
                __file__=path,
                __builtins__=builtins,
                __loader__=importlib.machinery.SourceFileLoader("__main__", path),
                __cached__=None,
            )
            sys.modules["__main__"] = main
            with open(path, "rb") as f:
                source = f.read()
            exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException as exc:
        # The traceback a fresh interpreter prints: without this function's frame.
        exc.with_traceback(exc.__traceback__.tb_next)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        # An uncaught KeyboardInterrupt ends a fresh interpreter by SIGINT.
        code = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    _finish(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish(code: int) -> None:
    """What an interpreter does at exit before tearing itself down: wait for its non-daemon threads, run the
    ``atexit`` handlers, flush the standard streams; then exit (by ``signal -code`` when negative)."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _serve_one(conn: socket.socket, log: str) -> None:
    """In a fork of the server: start the client's command in a fork of its own, forward the client's signals to
    it, report its exit status; kill it if the client goes away."""
    try:
        command, fds = _receive(conn)
    except (OSError, ValueError):
        os._exit(0)
    reason = _mismatch(command) if len(fds) == 3 else "no standard streams"
    argv = command.get("script") or "-m " + command.get("module", "?")
    if reason:
        _log(log, f"fallback {argv}: {reason}")
        conn.sendall(b"fallback\n")
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        try:
            conn.close()
            _run(command, fds)
        finally:  # never back into this function's loop
            os._exit(1)
    for fd in fds:
        os.close(fd)
    _log(log, f"forked {argv}")
    pidfd = os.pidfd_open(pid)
    conn.sendall(b"ok %d\n" % pid)
    while True:
        ready, _, _ = select.select([conn, pidfd], [], [])
        if pidfd in ready:
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status):
                reply = b"signal %d\n" % os.WTERMSIG(status)
            else:
                reply = b"exit %d\n" % os.waitstatus_to_exitcode(status)
            try:
                conn.sendall(reply)
            except OSError:
                pass
            os._exit(0)
        data = conn.recv(4096)
        if not data:  # the client was killed: so is its command
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os._exit(0)
        for line in data.splitlines():
            if line.startswith(b"kill "):
                os.kill(pid, int(line.split()[1]))


def _log(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def serve(path: str, log: str) -> None:
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):  # Linux before 5.3: no server, every command starts as usual
        return
    for name in IMPORTS:
        importlib.import_module(name)
    # The imported objects are never freed: keeping them out of the collector's generations spares every fork from
    # scanning (and so copying) them.
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    parent = os.getppid()
    while os.getppid() == parent:  # the test session that started the server has not ended
        ready, _, _ = select.select([listener], [], [], 1.0)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        if ready:
            conn, _ = listener.accept()
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                try:
                    listener.close()
                    _serve_one(conn, log)
                finally:  # never a second server
                    os._exit(1)
            conn.close()


def shell_signals() -> None:
    """Give this process the signal dispositions of a command started from a shell.

    pytest may run with SIGINT, SIGQUIT and SIGHUP ignored (as a background job of a non-interactive shell, or under
    nohup); a child inherits that, and Python then keeps ignoring SIGINT. The server, whose forks run the jobs, and the
    fresh interpreters the tests compare them with start as they would from a shell.
    """
    for name in ("SIGINT", "SIGQUIT", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)


class Server:
    """A server process, for commands run with `env`. It imports for ~10 s after it starts; until it listens,
    commands start as usual."""

    def __init__(self, env: dict[str, str]) -> None:
        self._dir = tempfile.mkdtemp(prefix="odc_warm_start_")
        self.socket = os.path.join(self._dir, "socket")
        self.log = os.path.join(self._dir, "log")
        self.env = site_env(env)
        self._proc = subprocess.Popen(
            [sys.executable, __file__, self.socket, self.log],
            env=self.env,
            stdin=subprocess.DEVNULL,
            preexec_fn=shell_signals,  # its forks inherit the server's signal handling
        )
        atexit.register(self.stop)

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Wait until the server listens (its imports done)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the warm-start server exited with status {self._proc.returncode}")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                if probe.connect_ex(self.socket) == 0:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"the warm-start server did not listen within {timeout:.0f} s")

    def entries(self) -> list[str]:
        """One line per command: ``forked ...`` or ``fallback ...: why``."""
        return Path(self.log).read_text().splitlines() if os.path.exists(self.log) else []

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        for name in (self.socket, self.log):
            if os.path.exists(name):
                os.unlink(name)
        if os.path.isdir(self._dir):
            os.rmdir(self._dir)


_server: Server | None = None
entries: list[str] = []  # the last stopped server's `Server.entries`


def start(env: dict[str, str]) -> Server:
    """Start the session's server for commands run with ``env`` (what `env` then gives them)."""
    global _server
    stop()
    _server = Server(env)
    return _server


def current() -> Server | None:
    """The session's server (None when not started)."""
    return _server


def stop() -> None:
    """Stop the session's server, keeping its `Server.entries` in `entries`."""
    global _server
    if _server:
        entries[:] = _server.entries()
        _server.stop()
        _server = None


def env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a command that starts warm when the session's server runs: the client hook on ``PYTHONPATH``
    and the server's socket. Any difference from the server's own environment outside per-process variables
    (ranks, ports, ``ODC_*``) makes the command start as usual."""
    if _server is None:
        return env
    return {**site_env(env), "ODC_TEST_WARM_START": _server.socket}


def site_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the client hook's folder on ``PYTHONPATH``."""
    path = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": f"{path}{os.pathsep}{SITE}" if path else str(SITE)}


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
