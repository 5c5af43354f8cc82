"""The engine benchmark runs end to end, ends with the JSON line other tools parse and stores the same summary in
``--out`` (figures are not asserted)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEYS = (
    "fsdp_balanced_ms",
    "fsdp_imbalanced_ms",
    "odc_balanced_ms",
    "odc_imbalanced_ms",
    "odc_layersync_imbalanced_ms",
    "fsdp_peak_rss_mb",
    "odc_peak_rss_mb",
)


def test_engine_benchmark_quick_run_prints_table_and_json_and_stores_them(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    lines = out.strip().splitlines()
    assert any(line.startswith("FSDP2 (gloo)") for line in lines)
    summary = json.loads(lines[-1])
    for key in KEYS:
        assert summary[key] > 0, key
    assert json.loads((tmp_path / "results.json").read_text()) == summary
    assert "FSDP2 (gloo)" in (tmp_path / "table.txt").read_text()
