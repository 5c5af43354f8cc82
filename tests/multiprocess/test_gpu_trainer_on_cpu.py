"""The GPU session's Trainer-level driver is tested code: ``python -m tests.helpers.gpu_trainer --device cpu`` runs
its SFT parity case on CPU (2 ranks under ``accelerate launch`` against TRL's trainer in one process) and writes the
results a GPU run writes; ``scripts/gpu_session.sh`` refuses an unknown step before doing anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multiprocess


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ODC_")}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return env


def test_trainer_driver_runs_its_sft_parity_case_on_cpu(tmp_path):
    cmd = [sys.executable, "-m", "tests.helpers.gpu_trainer", "--device", "cpu", "--cases", "sft_fp32"]
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + (tmp_path / "logs.txt").read_text()[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.txt", "results.json", "summary.txt"]
    result = json.loads((tmp_path / "results.json").read_text())["sft_fp32"]
    assert len(result["checks"]) == 8 and all(result["checks"].values()), result["checks"]
    assert result["transports"] == ["ShmTransport", "ShmTransport"]
    assert result["loss_max_rel"] <= 1e-4 and result["params_max_rel"] <= 1e-4
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.count("[ok]") == 8 and "FAIL" not in summary


def test_gpu_session_refuses_an_unknown_step_before_any_work(tmp_path):
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_session.sh"), "chek", str(tmp_path)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "unknown step 'chek': use check, trainer or calibrate" in proc.stderr
    assert list(tmp_path.iterdir()) == []
