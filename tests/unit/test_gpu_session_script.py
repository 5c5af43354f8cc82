"""The GPU procedure's one command, ``scripts/gpu_session.sh``, reads its own options: either spelling of
``--device cpu`` is the dry run (no wheels installed), and an unknown option is refused before anything runs.

The script runs unchanged from a copy of the repository's layout (its ``scripts/`` folder and a ``.whl/`` folder with
one wheel) with ``$PYTHON`` set to a stand-in that records each call and succeeds, reporting Python 3.12 (the version
the wheels are for): the calls show whether the wheels were installed and what the session driver was given.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = "-m tests.gpu.gpu_session"
INSTALL = "-m pip install"


@pytest.fixture
def layout(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu_session.sh", root / "scripts")
    (root / ".whl").mkdir()
    (root / ".whl" / "trl-0.0-py3-none-any.whl").write_bytes(b"")
    fake = tmp_path / "python3"
    # one line per call; `-c` (the version check) exits 0, i.e. "this is Python 3.12"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> "{tmp_path / "calls.log"}"\n')
    fake.chmod(0o755)
    return root


def _session(layout: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    env = {**os.environ, "PYTHON": str(layout.parent / "python3")}
    cmd = ["bash", str(layout / "scripts" / "gpu_session.sh"), "OUT", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    log = layout.parent / "calls.log"
    return proc, log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("spelling", [["--device", "cpu"], ["--device=cpu"]], ids=["space", "equals"])
def test_either_spelling_of_device_cpu_is_the_dry_run(layout, spelling):
    proc, calls = _session(layout, *spelling, "--cases=check:parity", "--budget-s", "60")
    assert proc.returncode == 0, proc.stderr
    assert not any(INSTALL in call for call in calls), calls  # the dry run installs no wheels
    assert calls[-1] == f"{DRIVER} --out OUT --device cpu --cases=check:parity --budget-s 60"


@pytest.mark.parametrize("spelling", [[], ["--device", "cuda"], ["--device=cuda"]], ids=["default", "space", "equals"])
def test_a_gpu_session_installs_the_wheels_first(layout, spelling):
    proc, calls = _session(layout, *spelling)
    assert proc.returncode == 0, proc.stderr
    assert [call.split(" .whl/")[0] for call in calls if INSTALL in call] == [
        f"{INSTALL} -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/odc_site"
    ]
    assert calls[-1] == f"{DRIVER} --out OUT --device cuda"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--devices=cpu"], "unknown option '--devices=cpu'"),
        (["--device", "cpu", "--dry-run"], "unknown option '--dry-run'"),
        (["--device=gpu"], "--device is cuda or cpu, not 'gpu'"),
        (["--device"], "--device needs a value"),
        (["--cases"], "--cases needs a value"),
    ],
)
def test_an_unknown_option_or_value_is_refused_before_anything_runs(layout, args, message):
    proc, calls = _session(layout, *args)
    assert proc.returncode == 2
    assert f"gpu_session.sh: {message}" in proc.stderr and "usage: bash scripts/gpu_session.sh" in proc.stderr
    assert calls == []  # neither the wheels nor the session driver ran


def test_the_output_folder_comes_first(layout):
    env = {**os.environ, "PYTHON": str(layout.parent / "python3")}
    cmd = ["bash", str(layout / "scripts" / "gpu_session.sh"), "--device=cpu"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "the first argument is the output folder" in proc.stderr


def test_the_session_knows_every_checkers_cases():
    # gpu_session.py names the checkers' cases without importing them (they import torch): the lists must agree
    from tests.gpu import gpu_check, gpu_session, gpu_trainer

    assert gpu_session.NAMES == {"check": gpu_check.CASES, "trainer": gpu_trainer.CASES}
    for case in (*gpu_session.GPU_CASES, *gpu_session.CPU_CASES):
        kind, _, name = case.partition(":")
        assert name in gpu_session.NAMES[kind] and case in gpu_session.CAPS, case
    assert {c.partition(":")[2] for c in gpu_session.CPU_CASES if c.startswith("check:")} <= set(gpu_check.CPU_CASES)


def test_the_ordered_case_runs_on_both_devices_before_the_cases_that_use_the_time_left():
    # check:ordered runs in the dry run (on the cuda transport's protocol over shared memory) and on a GPU, before
    # trainer:speed, which plans its repeats in whatever time is left of the session's budget
    from tests.gpu import check_common, check_ordered, gpu_check, gpu_session

    assert "ordered" in gpu_check.CASES and "ordered" in gpu_check.CPU_CASES
    for cases in (gpu_session.GPU_CASES, gpu_session.CPU_CASES):
        assert cases.index("check:ordered") < cases.index("trainer:speed")
    assert gpu_session.GPU_CASES.index("check:ordered") < gpu_session.GPU_CASES.index("check:speed")
    # every default case but the last fits the budget by its cap's share; the dry run keeps the CPU sizes tiny
    assert gpu_session.CAPS["check:ordered"] <= 90
    cpu, cuda = check_ordered.ORDERED["cpu"], check_ordered.ORDERED["cuda"]
    assert cpu["steps"] <= 3 and cpu["cfg"] == check_common.SMALL and cuda["steps"] >= 5
    # unequal microbatch counts per rank: the owners' sums mix contributions of different lengths
    for sizes in (cpu, cuda):
        assert len(sizes["lengths"]) == 2 and len(sizes["lengths"][0]) != len(sizes["lengths"][1])


def test_parameter_hashes_see_a_one_ulp_change():
    import torch

    from tests.gpu.check_ordered import param_hashes

    model = torch.nn.Linear(4, 3)
    before = param_hashes(model)
    assert before == param_hashes(model) and set(before) == {"weight", "bias"}
    with torch.no_grad():
        model.weight[1, 2] = torch.nextafter(model.weight[1, 2], torch.tensor(float("inf")))
    after = param_hashes(model)
    assert after["weight"] != before["weight"] and after["bias"] == before["bias"]
