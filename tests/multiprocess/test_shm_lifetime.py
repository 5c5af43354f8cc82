"""Shared-memory files have names only while the ranks set up, so none outlives a job, however it ends.

Each test identifies the job's files by the pids of its ranks (the shared-memory transport puts the creator's pid in
every file name), so files of other jobs on the machine do not count.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from odc_accelerate.testing import LaunchError, launch, read_pids, shm_files_of
from tests.helpers.workers.engine_workers import names_gone_after_engine_setup, reference
from tests.helpers.workers.failure_workers import names_gone_after_setup, train_until_stopped

PLAN = [[[9, 7], [8, 6]], [[5, 9], [7, 8]], [[6, 6], [9, 5]]]
ODC_NAME = re.compile(r"^odc_[0-9a-f]+_r\d+_p(?P<pid>\d+)\.(?:seg|lock)$")


def rel_diff(a: dict, b: dict) -> float:
    num = sum(float(((a[k].astype(np.float64) - b[k]) ** 2).sum()) for k in b)
    den = sum(float((b[k].astype(np.float64) ** 2).sum()) for k in b)
    return (num / den) ** 0.5


def test_names_are_gone_after_setup_and_the_unlinked_files_still_work(pid_dir):
    world, adds = 3, 200
    results = launch(names_gone_after_setup, world, str(pid_dir), adds, timeout=240)
    pids = read_pids(pid_dir)
    assert len(pids) == world
    job = results[0]["job_id"]
    for rank, res in enumerate(results):
        assert res["job_id"] == job
        # when register returns on any rank, no rank's name is left
        assert res["names_after_register"] == [], (rank, res["names_after_register"])
        # ... yet this rank maps every rank's segment and holds every rank's lock file, all unlinked and private
        assert res["segment_maps"] == sorted(f"/dev/shm/odc_{job}_r{r}_p{pids[r]}.seg (deleted)" for r in range(world))
        assert res["lock_fds"] == [f"/dev/shm/odc_{job}_r{r}_p{pids[r]}.lock (deleted)" for r in range(world)]
        assert res["lock_modes"] == ["0o600"] * world
        assert all(mode in ("0o600", None) for mode in res["segment_modes"]), res["segment_modes"]
        # reads, locked adds and barriers on the unlinked files
        assert res["reads"] == [[10.0 * peer + i for i in range(8)] for peer in range(world)]
        assert res["acc"] == [adds * world * (world + 1) / 2], res["acc"]
        assert res["names_at_end"] == []
    assert shm_files_of(pids) == []


def test_names_are_gone_after_engine_setup_and_training_matches_single_process():
    spec = dict(plan=PLAN)
    results = launch(names_gone_after_engine_setup, 2, spec, timeout=240)
    for res in results:
        assert res["names_after_setup"] == []
    ref = reference(spec)
    assert rel_diff(results[0]["params"], ref) <= 1e-5
    assert rel_diff(results[1]["params"], results[0]["params"]) == 0.0


def _signal_mid_run(pid_dir: Path, world: int, signals: list[tuple[int, int]], errors: list[str]) -> None:
    """Once every rank has finished 2 steps, send ``signals`` ((rank, signal), in order, back to back)."""
    deadline = time.monotonic() + 180
    markers = [pid_dir / f"rank{r}.steps" for r in range(world)]
    while time.monotonic() < deadline:
        try:
            if all(int(m.read_text()) >= 2 for m in markers):
                break
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    else:
        errors.append("the ranks did not reach step 2")
        return
    pids = read_pids(pid_dir)
    for rank, sig in signals:
        os.kill(pids[rank], sig)


def _run_and_signal(pid_dir: Path, world: int, signals: list[tuple[int, int]]) -> list:
    errors: list[str] = []
    killer = threading.Thread(target=_signal_mid_run, args=(pid_dir, world, signals, errors), daemon=True)
    killer.start()
    results = launch(
        train_until_stopped, world, dict(pid_dir=str(pid_dir), seconds=200), timeout=260, allow_failures=True
    )
    killer.join()
    assert errors == []
    return results


def test_sigkill_of_one_rank_then_sigterm_of_the_survivor_leaves_no_file(pid_dir):
    # as torchrun does when a rank dies: the others get SIGTERM, which runs no finaliser
    results = _run_and_signal(pid_dir, 2, [(1, signal.SIGKILL), (0, signal.SIGTERM)])
    assert "exited with code -9" in results[1], results[1]
    # the survivor is killed by the SIGTERM, or names the dead peer first if it gets there before
    assert "exited with code -15" in results[0] or "ODCTimeoutError" in results[0], results[0]
    pids = read_pids(pid_dir)
    assert len(pids) == 2 and shm_files_of(pids) == []


def test_sigkill_of_every_rank_leaves_no_file(pid_dir):
    results = _run_and_signal(pid_dir, 2, [(0, signal.SIGKILL), (1, signal.SIGKILL)])
    assert all("exited with code -9" in r for r in results), results
    pids = read_pids(pid_dir)
    assert len(pids) == 2 and shm_files_of(pids) == []


def test_exception_on_one_rank_leaves_no_file(pid_dir):
    spec = dict(pid_dir=str(pid_dir), seconds=200, raise_at=(1, 2))
    with pytest.raises(LaunchError) as info:
        launch(train_until_stopped, 2, spec, timeout=260)
    assert "fails on purpose at step 2" in info.value.failures[1]
    assert "ODCTimeoutError" in info.value.failures[0] and "rank 1 (pid" in info.value.failures[0]
    pids = read_pids(pid_dir)
    assert len(pids) == 2 and shm_files_of(pids) == []


def _children(pid: int) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2 :].split()[1]) == pid:
                out.add(int(entry))
    return out


def _odc_names() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if ODC_NAME.match(name)}


def test_ctrl_c_of_accelerate_launch_leaves_no_file(tmp_path):
    from integration_utils import ROOT, base_env

    before = _odc_names()
    log = tmp_path / "launch.log"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", "examples/sft/configs/odc_cpu.yaml", "--main_process_port", "0",
        "examples/sft/train.py", "--odc", "true", "--max_steps", "50", "--logging_steps", "1",
        "--output_dir", str(tmp_path / "out"), "--report_to", "none",
    ]  # fmt: skip
    # Fresh interpreters (no warm start): the test follows the launcher's own process tree, as Ctrl-C reaches it.
    with open(log, "wb") as out:
        launcher = subprocess.Popen(
            cmd, cwd=ROOT, env=base_env(warm=False), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    ranks: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        # a logged step means every rank is past the engine's set-up
        while "'loss'" not in log.read_text(errors="replace"):
            assert launcher.poll() is None, f"the launcher exited early:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no step logged:\n{log.read_text()[-4000:]}"
            ranks |= _children(launcher.pid)
            time.sleep(0.2)
        ranks |= _children(launcher.pid)
        assert len(ranks) >= 2, ranks
        while_training = shm_files_of(sorted(ranks))
        os.killpg(launcher.pid, signal.SIGINT)
        launcher.wait(timeout=120)
        # the launcher waits for its ranks; none may outlive it
        survivors = [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]
        assert survivors == [], survivors
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    # the job's names were gone while it trained, and nothing its ranks created is left after Ctrl-C
    assert while_training == [], while_training
    assert shm_files_of(sorted(ranks)) == []
    created = sorted(_odc_names() - before)
    assert [n for n in created if int(ODC_NAME.match(n)["pid"]) in ranks] == [], created
