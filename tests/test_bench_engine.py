"""The engine benchmark runs end to end and ends with the JSON line other tools parse (figures are not asserted)."""

import json
import subprocess
import sys

KEYS = (
    "fsdp_balanced_ms",
    "fsdp_imbalanced_ms",
    "odc_balanced_ms",
    "odc_imbalanced_ms",
    "odc_layersync_imbalanced_ms",
    "fsdp_peak_rss_mb",
    "odc_peak_rss_mb",
)


def test_engine_benchmark_quick_run_prints_table_and_json():
    out = subprocess.run(
        [sys.executable, "-m", "odc_accelerate.bench", "engine", "--quick"],
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


def test_bench_dispatcher_rejects_unknown_names():
    proc = subprocess.run([sys.executable, "-m", "odc_accelerate.bench", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2 and "engine" in proc.stderr
