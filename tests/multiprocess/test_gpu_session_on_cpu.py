"""The GPU procedure is tested code: its one command's CPU dry run, ``bash scripts/gpu_session.sh OUT --device cpu``,
runs every case that exists on CPU (the engine's parity through ``gpu_check``: the ``shm`` transport and the ``cuda``
transport's protocol over shared memory; the SFT Trainer against TRL's in one process; GRPO) and leaves what a GPU
machine sends back: at most 8 files (an archive and the summary), the table printed last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ODC_") or k == "ODC_OFFLINE_BPE_RANKS"}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return env


def _session(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = ["bash", str(ROOT / "scripts" / "gpu_session.sh"), str(out), *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1800)


def test_gpu_session_dry_run_on_cpu_runs_every_cpu_case_and_returns_two_files(tmp_path):
    out = tmp_path / "out"
    proc = _session(out, "--device", "cpu")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["session.tar.gz", "summary.txt"]
    summary = (out / "summary.txt").read_text()
    # The table is what the command prints last, and its form: a header, then one row per case, all passed.
    assert proc.stdout.endswith(summary)
    lines = summary.splitlines()
    assert lines[0].startswith("GPU session (cpu), ") and lines[1].split() == ["case", "status", "checks", "s"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == {"check:parity", "trainer:sft_fp32", "trainer:grpo"}
    for row in rows.values():
        passed, total = map(int, row[2].split("/"))
        assert row[1] == "pass" and passed == total > 0, row
    with tarfile.open(out / "session.tar.gz") as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "unpacked", filter="data")
    assert "session/env.txt" in names and "session/summary.txt" in names
    unpacked = tmp_path / "unpacked" / "session"
    parity = json.loads((unpacked / "check_parity" / "results.json").read_text())
    assert set(parity) == {"environment", "parity"}
    checks = parity["parity"]["checks"]
    # both transports, fp32 and the bf16 variants, each compared against one process
    assert len(checks) == 7 and all(checks.values()), checks
    assert any("cuda-on-cpu" in name for name in checks) and any("shm" in name for name in checks)
    # fp32 accumulators take the accumulate kernel (Triton's interpreter on CPU tensors); bf16 ones the index_add_
    # fallback (the interpreter has no bf16 atomics)
    paths = {run: res["accumulate_path"] for run, res in parity["parity"].items() if "cuda-on-cpu" in run}
    assert paths == {
        "fp32/cuda-on-cpu": "kernel",
        "bf16-fp32-reduce/cuda-on-cpu": "kernel",
        "bf16/cuda-on-cpu": "kernel",
        "bf16/cuda-on-cpu-bf16-acc": "index_add_",
    }, paths
    sft = json.loads((unpacked / "trainer_sft_fp32" / "results.json").read_text())["sft_fp32"]
    # ODC on 2 ranks with unequal microbatches against TRL's trainer in one process, through the shared-GPU switch
    # the weight updates, relative to the update's norm, from the same start, every tensor moved
    assert sft["loss_max_rel"] <= 1e-4 and sft["update_rel"] <= 1e-4
    assert sft["same_start"] and sft["unmoved"] == []
    assert sft["transports"] == ["ShmTransport", "ShmTransport"]
    # peak memory logged per step (on CPU the resident set; on a GPU torch's allocator peak)
    assert len(sft["peak_mem_mb_per_step"]) == 2 and all(m > 0 for m in sft["peak_mem_mb_per_step"])
    grpo = json.loads((unpacked / "trainer_grpo" / "results.json").read_text())["grpo"]
    assert all(grpo["checks"].values()) and len(grpo["loss"]) == 3


def test_gpu_session_refuses_an_unknown_case_before_any_work(tmp_path):
    out = tmp_path / "out"
    proc = _session(out, "--cases", "check:parity,chek:memory")
    assert proc.returncode == 2 and "unknown case 'chek:memory'" in proc.stderr
    assert not out.exists()
