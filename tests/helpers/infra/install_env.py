"""The fresh environment of the install tests (`tests/install/test_wheel.py`): the wheel built from a copy of the
checkout, installed with ``[hf,demo]`` into a new virtual environment that already holds torch 2.13.0 and the newest
``trl`` and ``transformers`` from the registry.

Building it is mostly pip: downloads, unpacking torch. `start` runs it in a background thread as soon as the session
knows it has install tests (`tests/conftest.py`), which it runs last, so that the other tests run meanwhile; `result`
waits for it; `stop` kills what is still running and removes the folder at the end of the session.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

_ROOT = Path(__file__).parents[3]
# torch first and exact: 2.13.0 is the CPU wheel this machine's pip finds on disk (an unpinned torch would be the
# multi-GB CUDA build); then trl and transformers unpinned: whatever the registry has newest.
_BEFORE = ("torch==2.13.0", "trl", "transformers")
KEPT = ("torch", "trl", "transformers")
EXTRAS = "hf,demo"
# This interpreter's pip drives the fresh environment (``--python``, pip >= 22.3), which then needs no pip of its own:
# bootstrapping one (ensurepip) would be the slowest step after torch.
_PIP = (sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input")


def env() -> dict[str, str]:
    """This process's environment without what would let the fresh venv see another environment or this checkout."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
    }
    env["PYTHONNOUSERSITE"] = "1"
    env.pop("ODC_OFFLINE_BPE_RANKS", None)  # the installed commands train the true offline default
    return env


def command(cmd: tuple[str | Path, ...]) -> list[str]:
    return [str(c) for c in cmd]


def check(cmd: tuple[str | Path, ...], out: subprocess.CompletedProcess) -> str:
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(command(cmd))} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out.stdout


def run(*cmd: str | Path, cwd: Path, timeout: float = 600) -> str:
    """Run ``cmd`` (outside the checkout, so ``import odc_accelerate`` cannot pick up its sources); its stdout."""
    proc = _popen(cmd, cwd)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        _reap(proc)
    return check(cmd, subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr))


def _popen(cmd: tuple[str | Path, ...], cwd: Path) -> subprocess.Popen:
    with _lock:
        if _state.get("stopping"):
            raise RuntimeError("the install tests' environment build was stopped")
        proc = subprocess.Popen(
            command(cmd), cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        _procs.add(proc)
    return proc


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    with _lock:
        _procs.discard(proc)


def pip(python: Path, *args: str | Path, cwd: Path) -> str:
    """``pip ARGS`` on the environment of ``python``; its stdout."""
    return run(*_PIP, "--python", python, *args, cwd=cwd)


def _install(python: Path, *requirements: str | Path, cwd: Path) -> None:
    # Quiet, and no byte-compilation (the slowest part of unpacking torch and transformers).
    pip(python, "install", "-q", "--no-compile", *requirements, cwd=cwd)


def _pip_list(python: Path, cwd: Path) -> dict[str, str]:
    """Installed distributions of ``python``'s environment, by normalised name -> version."""
    rows = json.loads(pip(python, "list", "--format", "json", cwd=cwd))  # not -q: that hides the list
    return {row["name"].lower().replace("_", "-"): row["version"] for row in rows}


def _ignore_for_copy(folder: str, names: list[str]) -> set[str]:
    """Leave out git data, build output, caches and any virtual environment (a folder holding ``pyvenv.cfg``)."""
    skipped = {".git", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis"}
    return {
        name
        for name in names
        if name in skipped or name.endswith(".egg-info") or os.path.isfile(os.path.join(folder, name, "pyvenv.cfg"))
    }


def _start_wheel_build(tmp: Path) -> tuple[tuple[str | Path, ...], subprocess.Popen, Path]:
    """Start ``pip wheel`` of a copy of the checkout (it runs while the environment is set up); returns the command,
    the process and the wheel folder."""
    # A copy: an in-tree build writes build/ and *.egg-info into the checkout, and a stale build/lib from an earlier
    # build would put deleted modules into the wheel.
    source = tmp / "source"
    shutil.copytree(_ROOT, source, ignore=_ignore_for_copy)
    wheels = tmp / "wheels"
    cmd = (*_PIP, "wheel", "-q", "--no-deps", "-w", wheels, source)
    return cmd, _popen(cmd, tmp), wheels


def _finish_wheel_build(cmd: tuple[str | Path, ...], proc: subprocess.Popen, wheels: Path) -> Path:
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        _reap(proc)
    check(cmd, subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr))
    (wheel,) = wheels.glob("odc_accelerate-*.whl")
    return wheel


@dataclass(frozen=True)
class Installed:
    python: Path  # the fresh environment's interpreter
    wheel: Path
    before: dict[str, str]  # pip list before the wheel was installed (torch, the newest trl and transformers)
    after: dict[str, str]


def _build_and_install(tmp: Path) -> Installed:
    build = _start_wheel_build(tmp)
    try:
        venv = tmp / "venv"
        # Not --system-site-packages: the environment holds only what is installed below.
        run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp)
        python = venv / "bin" / "python"
        _install(python, *_BEFORE, cwd=tmp)
        before = _pip_list(python, tmp)
    except BaseException:
        _reap(build[1])
        raise
    wheel = _finish_wheel_build(*build)
    _install(python, f"{wheel}[{EXTRAS}]", cwd=tmp)
    installed = Installed(python=python, wheel=wheel, before=before, after=_pip_list(python, tmp))
    # Installed without byte-compiling: the first import of a module compiles it and writes its cache. Done once here,
    # in the background, for what the installed commands import; otherwise the runs' processes, which start together,
    # would each compile the same modules.
    run(python, "-c", _WARM_IMPORTS, cwd=tmp)
    return installed


_WARM_IMPORTS = (
    "import accelerate.commands.launch, odc_accelerate.cli.main, odc_accelerate.cli.bootstrap, "
    "odc_accelerate.scripts.sft, odc_accelerate.scripts.dpo, odc_accelerate.scripts.grpo, trl.scripts.sft"
)


_lock = threading.Lock()
_procs: set[subprocess.Popen] = set()  # the build's running commands, killed by `stop`
_state: dict[str, object] = {}


def start() -> None:
    """Start building the environment in a background thread (once per session)."""
    with _lock:
        if "future" in _state:
            return
        tmp = Path(tempfile.mkdtemp(prefix="odc-install-test-"))
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="odc-install-env")
        _state.update(tmp=tmp, executor=executor, future=executor.submit(_build_and_install, tmp))


def result() -> Installed:
    """The built environment (started now if `start` was not called); raises what its build raised."""
    start()
    future = _state["future"]
    assert isinstance(future, Future)
    return future.result()


def stop() -> None:
    """Kill what the build still runs, wait for its thread and remove its folder (over a GB: torch)."""
    with _lock:
        if "future" not in _state:
            return
        _state["stopping"] = True
        for proc in list(_procs):
            proc.kill()
    _state["executor"].shutdown(wait=True)  # type: ignore[union-attr]
    shutil.rmtree(_state["tmp"], ignore_errors=True)  # type: ignore[arg-type]
    _state.clear()
