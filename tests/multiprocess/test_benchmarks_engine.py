"""The engine benchmark runs end to end, ends with the JSON line other tools parse, stores the same summary in
``--out``, and its table shows the summary's figures (their values are not asserted: benchmarks print them)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def _run(module: str, *args: str) -> str:
    """``python -m module args`` from the repository root; its standard output (a failure raises)."""
    cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout


def test_engine_benchmark_quick_run_prints_table_and_json_and_stores_them(tmp_path):
    out = _run("benchmarks.engine", "--quick", "--out", str(tmp_path))
    lines = out.strip().splitlines()
    summary = json.loads(lines[-1])
    for key in KEYS:
        assert summary[key] > 0, key
    assert json.loads((tmp_path / "results.json").read_text()) == summary
    table = (tmp_path / "table.txt").read_text()
    assert table in out  # what is printed is what is stored
    rows = {line[:26].strip(): line[26:].split() for line in table.splitlines()}
    for arm, prefix in (("FSDP2 (gloo)", "fsdp"), ("ODC", "odc")):
        balanced, imbalanced, ratio, rss = (float(x) for x in rows[arm])
        assert balanced == pytest.approx(summary[f"{prefix}_balanced_ms"], abs=0.051), arm
        assert imbalanced == pytest.approx(summary[f"{prefix}_imbalanced_ms"], abs=0.051), arm
        # The ratio column comes from the unrounded medians (the rounded ms columns can be a few percent off on
        # quick runs of a few ms), so it is checked against the stored figures, to the printed precision.
        exact = summary[f"{prefix}_imbalanced_ms"] / summary[f"{prefix}_balanced_ms"]
        assert ratio == pytest.approx(exact, abs=0.0051), arm
        assert rss == pytest.approx(summary[f"{prefix}_peak_rss_mb"], abs=0.51), arm
    ratios = dict(re.findall(r"^(ODC [^\d]+?|FSDP2 [^\d]+?)\s+([\d.]+)  \(target", table, flags=re.M))
    assert float(ratios["ODC imbalanced / ODC balanced"]) == pytest.approx(
        summary["odc_imbalanced_ms"] / summary["odc_balanced_ms"], abs=6e-4
    )
    assert float(ratios["FSDP2 imbalanced / ODC imbalanced"]) == pytest.approx(
        summary["fsdp_imbalanced_ms"] / summary["odc_imbalanced_ms"], abs=6e-4
    )


def test_engine_profile_quick_run_shows_each_arms_ops_and_the_engines_phases(tmp_path):
    arms = ("odc", "fsdp_floor", "limit")
    out = _run(
        "benchmarks.engine.profile", "--quick", "--steps", "1", "--arms", ",".join(arms), "--out", str(tmp_path)
    )
    results = json.loads((tmp_path / "profile.json").read_text())
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert set(r["wall_ms"]) == set(arms) and min(r["wall_ms"].values()) > 0
        # Every arm runs the same matmuls; ODC and the floor go through FSDP2's hooks, only ODC has engine phases.
        for arm in arms:
            assert r["ops_ms"][arm]["aten::mm"] > 0, arm
        for arm in ("odc", "fsdp_floor"):
            assert any(k.startswith("FSDP::") for k in r["ops_ms"][arm]), arm
        assert not any(k.startswith("FSDP::") for k in r["ops_ms"]["limit"])
        # The floor's hooks replace FSDP2's collectives: no process-group op runs in its step.
        assert not any(k.startswith("c10d::") and ("gather" in k or "reduce" in k) for k in r["ops_ms"]["fsdp_floor"])
        assert set(r["phases_ms"]) == {"odc"}
        phases = r["phases_ms"]["odc"]
        assert 0 < phases["gather_s"] + phases["scatter_s"] < r["wall_ms"]["odc"]
    assert (tmp_path / "profile.txt").read_text().strip() in out  # what is printed is what is stored


def test_engine_profile_refuses_an_unknown_arm():
    cmd = [sys.executable, "-m", "benchmarks.engine.profile", "--quick", "--arms", "odc,fsdp_flor"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown arms ['fsdp_flor']" in proc.stderr and "fsdp_floor" in proc.stderr
