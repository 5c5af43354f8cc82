"""A custom loop on `ODCEngine` ends cleanly: no gloo worker thread is left when the interpreter finalises.

`tests/helpers/loops/engine_loop.py` is the README's engine loop as a plain ``torchrun`` script: a tiny Qwen3-MoE,
``fully_shard`` per decoder layer and on the root, 3 optimizer steps on 2 CPU ranks (gloo), ``engine.close()``,
``dist.destroy_process_group()``, the model kept referenced until exit. A gloo worker still running at interpreter
shutdown can abort the finished run (``terminate called without an active exception``); each rank reports its threads
in its last exit handler.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from odc_accelerate.testing import shm_files_of

ROOT = Path(__file__).resolve().parents[2]
LOOP = ROOT / "tests" / "helpers" / "loops" / "engine_loop.py"
GLOO_THREADS = ("pt_gloo", "gloo_")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ODC_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def _run(cmd: list, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0 and "terminate called" not in proc.stderr, (
        f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    )


def _thread_reports(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("threads_rank*.json"))]


def _gloo(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith(GLOO_THREADS)]


@pytest.mark.parametrize(
    ("args", "gloo_left_at_exit"),
    [
        # The user's order (engine.close(), then destroy_process_group()), and one more step with FSDP2's own
        # collectives in between: close() must not release a group that still exists (the step would fail).
        pytest.param(["--fsdp2-steps-after-close", "1"], False, id="close-fsdp2-step-destroy"),
        # close() after destroy_process_group() releases the groups itself, without the exit handler.
        pytest.param(["--destroy-first", "--keep-exit-handler", "false"], False, id="destroy-then-close"),
        # Control: without the engine's exit handler gloo's workers are still running at exit, so the check sees them.
        pytest.param(["--keep-exit-handler", "false"], True, id="control-no-exit-handler"),
    ],
)
def test_torchrun_custom_loop_leaves_no_gloo_thread_at_exit(tmp_path, args, gloo_left_at_exit):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    _check_ok(_run([*launcher, LOOP, "--out", tmp_path, *args], timeout=300))
    ranks = _thread_reports(tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert _gloo(r["before_teardown"]), r  # the check can see gloo's workers: they run while the group exists
        assert bool(_gloo(r["at_exit"])) == gloo_left_at_exit, r


def test_custom_loop_never_aborts_at_exit_in_30_runs(tmp_path):
    """30 runs of the job, each rank a fresh process that exits through the normal interpreter shutdown.

    The ranks are forked from one process after its imports (a fresh interpreter spends ~6 s of CPU importing torch
    and transformers, the job itself about one): the same script, initialised from the environment as by torchrun.
    """
    runs = 30
    proc = _run([sys.executable, "-m", "tests.helpers.loops.engine_loop", "--repeat", runs, "--out", tmp_path], 600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = json.loads((tmp_path / "repeat.json").read_text())
    assert len(results) == runs
    failed = [r for r in results if r["exit_codes"] != [0, 0] or any(r["terminate_called"])]
    logs = {
        f"run{r['run']}_rank{k}": (tmp_path / f"run{r['run']}_rank{k}.log").read_text()[-3000:]
        for r in failed[:1]
        for k in range(2)
    }
    assert not failed, f"{len(failed)}/{runs} runs failed: {failed}\n{logs}"
    for r in results:
        ranks = _thread_reports(tmp_path / f"run{r['run']}")
        assert [t["rank"] for t in ranks] == [0, 1], r
        for t in ranks:
            assert _gloo(t["before_teardown"]) and not _gloo(t["at_exit"]), t
    assert shm_files_of([pid for r in results for pid in r["pids"]]) == []
