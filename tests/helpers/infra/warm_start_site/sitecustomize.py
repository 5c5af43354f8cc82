"""Test-only start-up hook: a Python process started with ``ODC_TEST_WARM_START=<socket>`` and this folder on its
``PYTHONPATH`` runs its script in a fork of the warm-start server (`tests/helpers/infra/warm_start.py`), which has torch,
transformers, TRL, accelerate and datasets imported already, instead of importing them itself (~9 s of CPU per
process). This process stays as a proxy with the same pid: the launcher's signals reach the fork, the fork's exit
status becomes this process's, and the fork is killed if this process is. When the server is not there or cannot run
this command as a fresh interpreter would (another environment, interpreter options), start-up goes on as usual.

Only what the standard library's start-up has imported is used here, so that the proxy itself starts in ~20 ms.
"""

import os

_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def _command(orig_argv: list[str]) -> dict | None:
    """``python [-u] script args...`` or ``python [-u] -m module args...``; None for any other command line."""
    unbuffered, rest = False, orig_argv[1:]
    while rest and rest[0] == "-u":
        unbuffered, rest = True, rest[1:]
    if not rest:
        return None
    if rest[0] == "-m" and len(rest) > 1:
        return {"module": rest[1], "args": rest[2:], "unbuffered": unbuffered}
    if rest[0].startswith("-"):
        return None
    return {"script": rest[0], "args": rest[1:], "unbuffered": unbuffered}


def _proxy(path: str) -> None:
    import json
    import signal
    import socket
    import struct
    import sys

    command = _command(sys.orig_argv)
    # Only the standard streams travel to the fork: a process handed other descriptors (multiprocessing's children
    # are) starts as usual.
    if command is None or _open_descriptors() != [0, 1, 2]:
        return
    command.update(env=dict(os.environ), cwd=os.getcwd(), executable=sys.executable)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        body = json.dumps(command).encode()
        socket.send_fds(sock, [struct.pack("!I", len(body)) + body], [0, 1, 2])
        replies = sock.makefile("rb")
        first = replies.readline().split()
    except OSError:
        sock.close()
        return
    if first[:1] != [b"ok"]:
        sock.close()
        return

    def forward(signum: int, frame: object) -> None:
        try:
            sock.sendall(b"kill %d\n" % signum)
        except OSError:
            pass

    for name in _SIGNALS:
        signal.signal(getattr(signal, name), forward)
    last = replies.readline().split()
    if last[:1] == [b"exit"]:
        os._exit(int(last[1]))
    if last[:1] == [b"signal"]:
        signum = int(last[1])
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)
    os.write(2, b"warm start: the server's fork ended without an exit status\n")
    os._exit(1)


def _open_descriptors() -> list[int]:
    """This process's open file descriptors (the one that listed them is closed by then)."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))
        except OSError:
            continue
        fds.append(int(name))
    return sorted(fds)


if os.environ.get("ODC_TEST_WARM_START"):
    _proxy(os.environ["ODC_TEST_WARM_START"])
