"""End-to-end benchmark, for real: two arms of ``python -m benchmarks.e2e sft --quick`` (2 processes each); every
reported figure is recomputed here from the runs' own logs. Timings are never asserted."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_sft_benchmark_quick_run_reports_the_trainers_own_figures(tmp_path):
    """Two real arms, 2 processes each; every reported figure is recomputed here from the runs' trainer_state.json."""
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.e2e", "sft", "--quick", "--no_limit", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((out / "results.json").read_text())
    arms = result["arms"]
    assert set(arms) == {"fsdp2_random", "odc"}
    for name in arms:
        run_out = out / "runs" / name / "rep0" / "out"
        history = json.loads((run_out / "trainer_state.json").read_text())["log_history"]
        rows = [r for r in history if "odc/step_s" in r][result["config"]["warmup"] :]
        assert rows, history
        tokens = sum(round(r["odc/tokens_per_s"] * r["odc/step_s"]) for r in rows)
        seconds = sum(r["odc/step_s"] for r in rows)
        assert arms[name]["tokens_per_s"] == pytest.approx(tokens / seconds)
        assert arms[name]["step_s"] == pytest.approx(statistics.median(r["odc/step_s"] for r in rows))
        busy = sum(statistics.fmean([r["odc/busy_s_rank0"], r["odc/busy_s_rank1"]]) for r in rows)
        assert arms[name]["bubble_pct"] == pytest.approx(100 * (1 - busy / seconds))
        assert len(arms[name]["peak_rss_mb"]) == 2 and min(arms[name]["peak_rss_mb"]) > 100
        reports = [json.loads((run_out / f"odc_run_rank{r}.json").read_text()) for r in (0, 1)]
        assert {rep["engine"] for rep in reports} == ({"ODCEngine"} if name == "odc" else {None})
        assert all(rep["fsdp_version"] == 2 for rep in reports)
        assert not list(run_out.glob("*.safetensors"))  # model files of runs are dropped
        # the step trace (telemetry.StepTrace) saw the same steps and tokens as the trainer's log
        (trace,) = result["runs"][name][0]["trace"]
        logged = [r for r in history if "odc/step_s" in r]
        assert len(trace) == 2 and all(len(t) == len(logged) for t in trace)
        for s, row in enumerate(logged):
            traced = sum(sum(mb["row_tokens"]) for t in trace for mb in t[s]["microbatches"])
            assert abs(traced - row["odc/tokens_per_s"] * row["odc/step_s"]) <= 1 + 0.05 * row["odc/step_s"]
            assert max(t[s]["step_s"] for t in trace) == pytest.approx(row["odc/step_s"], abs=1e-4)
    # plain FSDP2 blocks in its (timed) collectives: instrumentation is on, whatever the figure
    assert min(arms["fsdp2_random"]["wait_s"]) > 0.0
    assert arms["odc"]["speedup_vs_fsdp2_random"] == pytest.approx(
        arms["odc"]["tokens_per_s"] / arms["fsdp2_random"]["tokens_per_s"]
    )
    table = (out / "table.txt").read_text()
    # each arm's row shows its own figures
    for name, label in (("fsdp2_random", "FSDP2 + random"), ("odc", "ODC + plan free")):
        row = next(line for line in table.splitlines() if line.startswith(label))
        assert f"{arms[name]['tokens_per_s']:.1f}" in row and f"{arms[name]['step_s']:.2f}" in row, row
    assert "ODC + plan free" in (out / "README_snippet.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "e2e_sft.png").stat().st_size > 1000
