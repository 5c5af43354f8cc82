"""The warm start of launched jobs (`tests/helpers/infra/warm_start.py`): a command started as a fork of the session's
server behaves as the same command started as a fresh interpreter, which is the reference here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from integration_utils import base_env, run

from tests.helpers.infra import warm_start

# Everything a script can see of how it was started, bar its pid and the server's own module list.
FINGERPRINT = textwrap.dedent(
    """
    import atexit, json, os, sys, threading, time
    import torch

    def at_exit():
        with open(os.environ["ODC_TEST_OUT"] + ".atexit", "w") as f:
            f.write("ran")

    atexit.register(at_exit)

    def late():  # a non-daemon thread the interpreter waits for before the atexit handlers
        time.sleep(0.5)
        print("thread done", flush=True)

    threading.Thread(target=late).start()
    streams = {
        name: [type(s.buffer).__name__, s.line_buffering, s.write_through, s.encoding, s.errors, s.fileno()]
        for name, s in (("stdin", sys.stdin), ("stdout", sys.stdout), ("stderr", sys.stderr))
    }
    main = sys.modules["__main__"]
    print(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__, "file": __file__,
        "main_file": getattr(main, "__file__", None), "code_file": sys._getframe().f_code.co_filename,
        "main": [type(__builtins__).__name__, type(__loader__).__name__, __spec__, __package__, __cached__],
        "rank": os.environ.get("RANK"),
        "extra": os.environ.get("ODC_EXTRA"), "streams": streams, "torch_threads": torch.get_num_threads(),
    }))
    sys.stderr.write("to stderr\\n")
    code = sys.argv[1]
    if code == "raise":
        raise ValueError("raised by the script")
    sys.exit(int(code))
    """
)


@pytest.fixture(scope="module")
def server():
    server = warm_start.current()
    if server is None:
        pytest.skip("ODC_TEST_WARM_START=0: no warm-start server in this session")
    server.wait_ready()
    return server


def _start(cmd: list, warm: bool, tmp_path: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(c) for c in cmd],
        stdin=subprocess.PIPE,
        cwd=tmp_path,
        env=base_env(warm=warm, RANK="1", ODC_EXTRA="x", **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=warm_start.shell_signals,  # as from a shell, like the warm-start server
    )


def _outcome(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


# How the command gives the script's path x -u or not x how the script ends: each value of each twice.
CASES = [
    ("absolute", False, "0"), ("absolute", True, "3"), ("relative", False, "raise"),
    ("relative", True, "0"), ("link", False, "3"), ("link", True, "raise"),
]  # fmt: skip


@pytest.mark.parametrize(("given", "unbuffered", "code"), CASES)
def test_a_forked_script_runs_as_a_fresh_interpreter_would(server, tmp_path, code, unbuffered, given):
    script = tmp_path / "scripts" / f"fingerprint_{code}_{int(unbuffered)}.py"
    script.parent.mkdir()
    script.write_text(FINGERPRINT)
    # The path as a command gives it: absolute, relative to the working directory, or a link in another folder.
    path = {"absolute": script, "relative": Path("scripts") / script.name, "link": tmp_path / "link.py"}[given]
    if given == "link":
        path.symlink_to(script)
    cmd = [sys.executable, *(["-u"] if unbuffered else []), path, code]
    seen = {}
    for warm in (False, True):
        out = tmp_path / ("warm" if warm else "cold")
        returncode, stdout, stderr = _outcome(_start(cmd, warm, tmp_path, ODC_TEST_OUT=str(out), PYTHONUNBUFFERED=""))
        fingerprint, *rest = stdout.splitlines()
        seen[warm] = {
            "returncode": returncode,
            "fingerprint": json.loads(fingerprint),
            "rest of stdout": rest,
            "stderr": stderr,
            "atexit": out.with_suffix(".atexit").read_text(),
        }
    for key in seen[False]:
        assert seen[True][key] == seen[False][key], key
    warm = seen[True]
    assert warm["returncode"] == {"0": 0, "3": 3, "raise": 1}[code]
    assert warm["rest of stdout"] == ["thread done"] and "to stderr" in warm["stderr"]
    assert ("ValueError: raised by the script" in warm["stderr"]) == (code == "raise")
    assert server.entries().count(f"forked {path}") == 1


def test_a_forked_module_runs_with_its_arguments(server, tmp_path):
    cmd = [sys.executable, "-m", "json.tool", "--sort-keys"]
    outcomes = []
    for warm in (False, True):
        proc = _start(cmd, warm, tmp_path)
        out, err = proc.communicate('{"b": 1, "a": 2}', timeout=120)
        outcomes.append((proc.returncode, out, err))
    assert outcomes[0] == outcomes[1] == (0, '{\n    "a": 2,\n    "b": 1\n}\n', "")
    assert "forked -m json.tool" in server.entries()


SLEEPER = textwrap.dedent(
    """
    import os, signal, sys, time
    with open(sys.argv[1], "w") as f:
        f.write(str(os.getpid()))
    if sys.argv[2] == "exit-on-term":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    time.sleep(300)
    """
)


def _started_pid(pid_file: Path) -> int:
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, "the command did not start"
        time.sleep(0.05)
    return int(pid_file.read_text())


def _gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize(
    ("behaviour", "sent"),
    [("default", signal.SIGTERM), ("exit-on-term", signal.SIGTERM), ("default", signal.SIGINT)],
)
def test_signals_reach_the_fork_and_its_status_comes_back(server, tmp_path, behaviour, sent):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    seen = []
    for warm in (False, True):
        pid_file = tmp_path / f"pid{int(warm)}"
        proc = _start([sys.executable, script, pid_file, behaviour], warm, tmp_path)
        pid = _started_pid(pid_file)
        assert (pid != proc.pid) == warm  # the warm one runs in a fork of the server
        proc.send_signal(sent)
        code, out, err = _outcome(proc)
        seen.append((code, out, "KeyboardInterrupt" in err))
        assert _gone(pid)
    assert seen[1] == seen[0]
    assert seen[0][0] == (7 if behaviour == "exit-on-term" else -sent)


def test_killing_the_proxy_kills_the_fork(server, tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    pid_file = tmp_path / "pid"
    proc = _start([sys.executable, script, pid_file, "default"], True, tmp_path)
    fork = _started_pid(pid_file)
    proc.kill()
    proc.wait(timeout=30)
    assert _gone(fork), f"the fork {fork} outlived its killed proxy"


def test_what_a_fork_cannot_reproduce_starts_as_usual(server, tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import os\nprint(os.getpid())\n")
    # An environment read at import (here huggingface_hub's HF_HOME), and interpreter options the fork has not.
    for cmd, env in (([sys.executable, script], {"HF_HOME": str(tmp_path)}), ([sys.executable, "-B", script], {})):
        proc = _start(cmd, True, tmp_path, **env)
        code, out, _ = _outcome(proc)
        assert code == 0 and int(out) == proc.pid  # started as a fresh interpreter: the pid is the proxy's own
    assert f"fallback {script}: environment differs in HF_HOME" in server.entries()
    assert not any(entry.startswith(f"forked {script}") for entry in server.entries())


def test_the_integration_jobs_start_warm(server):
    """The suite's jobs, which these tests exist to speed up, do fork: no environment difference crept in."""
    proc = run([sys.executable, "-m", "accelerate.commands.launch", "--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "forked -m accelerate.commands.launch" in server.entries()
