"""The GPU checker is tested code: ``scripts/gpu_check.sh OUT --device cpu`` runs its parity case on CPU (the ``shm``
transport, and the ``cuda`` transport's protocol over shared memory), every check passes, and it writes the results
a GPU run writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_its_parity_case_on_cpu(tmp_path):
    out = tmp_path / "gpu_check"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ODC_")}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), "--device", "cpu"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"environment", "parity"}
    checks = results["parity"]["checks"]
    # both transports, fp32 and the bf16 variants, each compared against one process
    assert len(checks) == 7 and all(checks.values()), checks
    assert any("cuda-on-cpu" in name for name in checks) and any("shm" in name for name in checks)
    # fp32 accumulators take the accumulate kernel (Triton's interpreter on CPU tensors); bf16 ones the index_add_
    # fallback (the interpreter has no bf16 atomics)
    paths = {run: res["accumulate_path"] for run, res in results["parity"].items() if "cuda-on-cpu" in run}
    assert paths == {
        "fp32/cuda-on-cpu": "kernel",
        "bf16-fp32-reduce/cuda-on-cpu": "kernel",
        "bf16/cuda-on-cpu": "kernel",
        "bf16/cuda-on-cpu-bf16-acc": "index_add_",
    }, paths
    summary = (out / "summary.txt").read_text()
    assert summary.count("PASS") == 7 and "FAIL" not in summary
