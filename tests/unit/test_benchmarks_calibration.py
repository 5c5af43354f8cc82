"""The GPU calibration (`benchmarks.calibration`) on CPU: the fit, the loader's refusals, one real run of the module
with a tiny model, and the simulator reading its file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.calibration import (
    MODEL_CONFIGS,
    CalibrationError,
    fit_quadratic,
    load_calibration,
)
from benchmarks.calibration.cli import planner_check
from benchmarks.calibration.fit import fit_scaled
from benchmarks.calibration.load import FORMAT
from benchmarks.sim import Hardware, ModelSpec, simulate
from benchmarks.sim.cli import main as sim_main
from benchmarks.sim.scale import compute_sources
from odc_accelerate.planning import QuadraticCost, cost_from_config

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = np.array([256, 512, 1024, 2048, 4096, 8192, 16384, 32768])
# H100-like magnitudes: 25 ms fixed, 40 us per token, 0.5 ns per squared token.
C, A, B = 0.025, 4e-5, 5e-10


def _seconds(lengths, c=C, a=A, b=B):
    x = np.asarray(lengths, dtype=np.float64)
    return c + a * x + b * x * x


def test_fit_recovers_known_coefficients():
    exact = fit_quadratic(LENGTHS, _seconds(LENGTHS))
    assert (exact.intercept_s, exact.linear_s, exact.quadratic_s) == pytest.approx((C, A, B), rel=1e-8)
    assert exact.max_rel_error < 1e-9
    assert exact.cost == QuadraticCost(linear=exact.linear_s, quadratic=exact.quadratic_s)

    # 1% multiplicative noise: coefficients within a few percent, errors reported per point as (fit - y) / y.
    noisy_y = _seconds(LENGTHS) * (1 + 0.01 * np.random.default_rng(0).standard_normal(LENGTHS.size))
    noisy = fit_quadratic(LENGTHS, noisy_y)
    assert noisy.intercept_s == pytest.approx(C, rel=0.1)
    assert noisy.linear_s == pytest.approx(A, rel=0.05)
    assert noisy.quadratic_s == pytest.approx(B, rel=0.05)
    by_hand = (noisy.intercept_s + noisy.linear_s * LENGTHS + noisy.quadratic_s * LENGTHS**2 - noisy_y) / noisy_y
    np.testing.assert_allclose(noisy.rel_errors, by_hand, rtol=1e-12)
    assert noisy.max_rel_error == pytest.approx(np.abs(by_hand).max())
    assert noisy.max_rel_error < 0.03


def test_fit_scaled_tells_a_cost_model_with_the_right_terms_from_one_without():
    # A hybrid-like model whose L^2 term is a quarter of the dense one: the cost model that charges a quarter fits
    # exactly (any unit, any fixed cost), the one that charges the whole term does not.
    quarter = QuadraticCost(linear=4e-5, quadratic=B / 4)
    seconds = 0.03 + 7.0 * quarter(LENGTHS)
    c, k, errors = fit_scaled(LENGTHS, seconds, quarter)
    assert (c, k) == pytest.approx((0.03, 7.0), rel=1e-8)
    assert max(abs(e) for e in errors) < 1e-9
    *_, wrong = fit_scaled(LENGTHS, seconds, QuadraticCost(linear=4e-5, quadratic=B))
    by_hand = fit_scaled(LENGTHS, seconds, QuadraticCost(linear=4e-5, quadratic=B))
    pred = by_hand[0] + by_hand[1] * QuadraticCost(linear=4e-5, quadratic=B)(LENGTHS)
    np.testing.assert_allclose(wrong, (pred - seconds) / seconds, rtol=1e-9, atol=1e-12)
    assert max(abs(e) for e in wrong) > 0.1
    with pytest.raises(ValueError, match="2 distinct lengths"):
        fit_scaled([512, 512], [1.0, 1.0], quarter)


def testplanner_check_of_a_hybrid_compares_the_term_per_layer_kind_with_every_layer():
    # Times that follow the per-kind cost model exactly: the planner check reports ~0 for it, and a clear error for
    # the same model charged the L^2 term on every layer.
    config = MODEL_CONFIGS["qwen3.5-moe-small-hybrid"]
    seconds = 0.04 + 3e-12 * cost_from_config(config)(LENGTHS)
    entry = {
        "config": config,
        "points": [{"length": int(n), "median_s": float(t)} for n, t in zip(LENGTHS, seconds, strict=True)],
    }
    check = planner_check(entry)
    assert check["planner_cost_max_rel_error"] < 1e-9
    assert check["planner_cost_every_layer_max_rel_error"] > 0.05


def test_fit_keeps_coefficients_non_negative():
    # Times that bend downwards: an unconstrained fit gives a negative L^2 term; the constrained one drops it and
    # is the best straight line (c + a L) in relative terms.
    y = _seconds(LENGTHS, b=0) - 1e-10 * LENGTHS.astype(float) ** 2
    unconstrained = np.polyfit(LENGTHS, y, 2)
    assert unconstrained[0] < 0
    fit = fit_quadratic(LENGTHS, y)
    assert fit.quadratic_s == 0 and fit.linear_s > 0 and fit.intercept_s >= 0
    line = np.stack([np.ones(LENGTHS.size), LENGTHS], axis=1) / y[:, None]
    coef, *_ = np.linalg.lstsq(line, np.ones(LENGTHS.size), rcond=None)
    assert (fit.intercept_s, fit.linear_s) == pytest.approx(tuple(coef), rel=1e-8)


@pytest.mark.parametrize(
    ("lengths", "seconds", "match"),
    [
        ([256, 512, 512], [1.0, 2.0, 2.0], "3 distinct lengths"),
        ([256, 512, 1024], [1.0, 2.0], "one time per length"),
        ([256, 512, 1024], [1.0, 0.0, 2.0], "positive, finite times"),
        ([0, 512, 1024], [1.0, 2.0, 3.0], "positive lengths"),
        ([256, 512, 1024], [3.0, 2.0, 1.0], "do not grow with the length"),
    ],
)
def test_fit_refuses_bad_input(lengths, seconds, match):
    with pytest.raises(ValueError, match=match):
        fit_quadratic(lengths, seconds)


def _entry(model: str, config: dict, c=C, a=A, b=B, attn="sdpa") -> dict:
    return {
        "model": model,
        "attn_implementation": attn,
        "config": config,
        "points": [{"length": int(n), "median_s": float(_seconds(n, c, a, b))} for n in LENGTHS],
        "fit": {
            "intercept_s": c,
            "linear_s_per_token": a,
            "quadratic_s_per_token2": b,
            "max_rel_error": 0.0,
        },
    }


def _write(path: Path, *entries: dict, **top) -> Path:
    data = {"format": FORMAT, "device": {"type": "cuda", "name": "Test GPU"}, "settings": {}, "models": list(entries)}
    path.write_text(json.dumps(data | top))
    return path


def test_loader_reads_a_model(tmp_path):
    path = _write(tmp_path / "calibration.json", _entry("qwen2.5-1.5b", MODEL_CONFIGS["qwen2.5-1.5b"]))
    cal = load_calibration(tmp_path, "qwen2.5-1.5b")  # the folder works too
    assert cal.cost == QuadraticCost(linear=A, quadratic=B)
    assert cal.seconds_per_token == A and cal.intercept_s == C
    assert cal.seconds(1000) == pytest.approx(C + A * 1000 + B * 1e6)
    assert cal.lengths == tuple(LENGTHS.tolist()) and cal.device == "Test GPU" and cal.path == str(path)
    assert "Test GPU" in cal.describe() and str(path) in cal.describe()


def _bad(tmp_path: Path, mutate) -> Path:
    entry = _entry("qwen2.5-1.5b", MODEL_CONFIGS["qwen2.5-1.5b"])
    data = {"format": FORMAT, "device": {"name": "Test GPU"}, "settings": {}, "models": [entry]}
    mutate(data)
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.update(format="something-else"), "not a calibration file"),
        (lambda d: d.pop("models"), "has no 'models'"),
        (lambda d: d.update(models={"qwen2.5-1.5b": {}}), r"\['models'\] must be a list"),
        (lambda d: d["models"][0].pop("model"), r"models\[0\] has no 'model'"),
        (lambda d: d["models"][0]["fit"].update(linear_s_per_token=-1.0), "must be finite and >= 0"),
        (lambda d: d["models"][0]["fit"].update(quadratic_s_per_token2="fast"), "must be a int or float"),
        (lambda d: d["models"][0]["fit"].update(intercept_s=True), "must be a int or float"),
        (lambda d: d["models"][0]["fit"].pop("max_rel_error"), "has no 'max_rel_error'"),
        (lambda d: d["models"][0]["fit"].update(linear_s_per_token=0, quadratic_s_per_token2=0), "no length-depend"),
        (lambda d: d["models"][0].update(fit=None, stopped="out of memory at 256 tokens"), "out of memory at 256"),
        (lambda d: d["models"][0].update(fit=[1, 2]), r"\['fit'\] must be a dict"),
        (lambda d: d["models"][0].update(points=[]), "no measured points"),
        (lambda d: d["models"][0].pop("config"), "has no 'config'"),
    ],
)
def test_loader_refuses_malformed_files(tmp_path, mutate, match):
    path = _bad(tmp_path, mutate)
    with pytest.raises(CalibrationError, match=match):
        load_calibration(path, "qwen2.5-1.5b")


def test_loader_errors_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m benchmarks.calibration --device cuda"):
        load_calibration(tmp_path / "missing.json", "qwen2.5-1.5b")
    (tmp_path / "broken.json").write_text('{"format": ')
    with pytest.raises(CalibrationError, match="not valid JSON"):
        load_calibration(tmp_path / "broken.json", "qwen2.5-1.5b")
    path = _write(tmp_path / "c.json", _entry("qwen2.5-0.5b", MODEL_CONFIGS["qwen2.5-0.5b"]))
    with pytest.raises(CalibrationError, match=r"no model 'qwen2.5-1.5b' \(it has \['qwen2.5-0.5b'\]\).*--models"):
        load_calibration(path, "qwen2.5-1.5b")
    two = _write(
        tmp_path / "two.json",
        _entry("qwen2.5-0.5b", MODEL_CONFIGS["qwen2.5-0.5b"]),
        _entry("qwen2.5-0.5b", MODEL_CONFIGS["qwen2.5-0.5b"], a=2 * A, attn="flash_attention_2"),
    )
    with pytest.raises(CalibrationError, match="several attention kernels"):
        load_calibration(two, "qwen2.5-0.5b")
    assert load_calibration(two, "qwen2.5-0.5b", "flash_attention_2").cost.linear == 2 * A
    with pytest.raises(CalibrationError, match="not with attn_implementation='eager'"):
        load_calibration(two, "qwen2.5-0.5b", "eager")


def test_simulator_charges_calibrated_seconds_per_microbatch(tmp_path):
    path = _write(tmp_path / "calibration.json", _entry("qwen2.5-1.5b", MODEL_CONFIGS["qwen2.5-1.5b"]))
    models, sources = compute_sources(["1.5b", "7b"], str(path), 396.0)
    assert models["1.5b"].seconds == QuadraticCost(A, B) and models["1.5b"].fixed_s == C
    assert sources["1.5b"].startswith("measured on Test GPU") and models["7b"].seconds is None
    assert sources["7b"].startswith("FLOP count at 396 TFLOP/s") and "has no qwen2.5-7b" in sources["7b"]
    # One rank, no communication: the step is the microbatches' compute. A packed microbatch pays the linear and
    # quadratic terms per sample and the fixed term once; an empty rank slot pays nothing.
    hw = Hardware(flops=1.0, gpus_per_node=1, intra_bw=1e30, inter_bw=1e30)  # flops unused when measured
    lengths = np.array([1000, 3000, 8000])
    res = simulate([[[0, 1], [2]]], lengths, models["1.5b"], hw, "odc")
    expected = 2 * C + A * lengths.sum() + B * (lengths.astype(float) ** 2).sum()
    assert res.step_s == pytest.approx(expected, rel=1e-12)
    assert res.limit_s == pytest.approx(expected, rel=1e-12)


def test_scale_cli_names_its_compute_source(tmp_path, capsys):
    path = _write(tmp_path / "calibration.json", _entry("qwen2.5-1.5b", MODEL_CONFIGS["qwen2.5-1.5b"]))
    args = ["scale", "--models", "1.5b", "--worlds", "8", "--steps", "1", "--samples-per-rank", "2", "--json"]
    assert sim_main(args + ["--calibration", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"compute, 1.5b: measured on Test GPU (sdpa; lengths 256-32768, fit max error 0.0%) from {path}" in out
    measured = json.loads(out.strip().splitlines()[-1])
    assert sim_main(args) == 0
    out = capsys.readouterr().out
    assert "compute, 1.5b: FLOP count at 396 TFLOP/s per GPU (assumed)" in out
    assumed = json.loads(out.strip().splitlines()[-1])
    assert measured["compute_source"]["1.5b"].startswith("measured") and "assumed" in assumed["compute_source"]["1.5b"]
    # Same steps (same seed), other compute figures: every arm's prediction moves.
    for arm, figures in measured["1.5b"]["8"].items():
        assert figures["step_s"] != pytest.approx(assumed["1.5b"]["8"][arm]["step_s"], rel=1e-3)

    # A file whose model shape is not the simulator's is refused, naming both.
    wrong = dict(MODEL_CONFIGS["qwen2.5-1.5b"], hidden_size=2048)
    _write(path, _entry("qwen2.5-1.5b", wrong))
    with pytest.raises(SystemExit) as exc:
        sim_main(args + ["--calibration", str(path)])
    assert exc.value.code == 2
    assert "is not the simulator's" in capsys.readouterr().err


def test_measure_stops_at_its_deadline(tmp_path):
    from benchmarks.calibration.measure import run_job

    job = {
        "model": "tiny",
        "attn_implementation": "sdpa",
        "config": MODEL_CONFIGS["tiny"],
        "device": "cpu",
        "dtype": "float32",
        "lengths": [16, 32, 64],
        "warmup": 1,
        "repeats": 3,
        "min_repeats": 3,
        "gradient_checkpointing": False,
        "seed": 0,
        "deadline_unix": time.time() - 1,  # already past: nothing is timed
    }
    result = run_job(job, tmp_path / "result.json")
    assert result["points"] == [] and "time budget: lengths [16, 32, 64] not measured" in result["stopped"]
    assert json.loads((tmp_path / "result.json").read_text()) == result


def test_module_on_cpu_writes_a_file_the_loader_and_simulator_accept(tmp_path):
    out = tmp_path / "calib"
    cmd = [sys.executable, "-m", "benchmarks.calibration", "--device", "cpu", "--models", "tiny"]
    # Lengths far apart: on a shared CPU, noise would swamp the difference between close short lengths.
    cmd += ["--lengths", "64,512,2048", "--warmup", "1", "--repeats", "3", "--threads", "1", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[calibration] tiny (sdpa): L=  2048" in proc.stdout  # progress is printed as it goes
    data = json.loads((out / "calibration.json").read_text())
    assert data["format"] == FORMAT and data["device"]["type"] == "cpu"
    assert data["versions"]["torch"] and data["versions"]["transformers"] and data["created"]
    (entry,) = data["models"]
    assert entry["model"] == "tiny" and entry["config"] == MODEL_CONFIGS["tiny"]
    assert [p["length"] for p in entry["points"]] == [64, 512, 2048]
    for p in entry["points"]:
        assert len(p["times_s"]) == 3 and p["median_s"] == sorted(p["times_s"])[1]
    fit = entry["fit"]
    # The stored errors are the stored coefficients against the stored medians.
    for p, err in zip(entry["points"], fit["rel_errors"], strict=True):
        pred = (
            fit["intercept_s"]
            + fit["linear_s_per_token"] * p["length"]
            + fit["quadratic_s_per_token2"] * p["length"] ** 2
        )
        assert err == pytest.approx((pred - p["median_s"]) / p["median_s"], rel=1e-9, abs=1e-12)
    assert fit["max_rel_error"] == pytest.approx(max(abs(e) for e in fit["rel_errors"]))
    # The planner's own cost model against the same medians (a dense model: no every-layer counterpart).
    *_, planner = fit_scaled(
        [p["length"] for p in entry["points"]],
        [p["median_s"] for p in entry["points"]],
        cost_from_config(entry["config"]),
    )
    assert fit["planner_cost_max_rel_error"] == pytest.approx(max(abs(e) for e in planner), rel=1e-9)
    assert "planner_cost_every_layer_max_rel_error" not in fit
    summary = (out / "summary.txt").read_text()
    assert "tiny (sdpa)" in summary and "max relative error" in summary and "the planner's cost model" in summary

    cal = load_calibration(out / "calibration.json", "tiny")
    assert cal.cost.linear == fit["linear_s_per_token"] and cal.cost.quadratic == fit["quadratic_s_per_token2"]
    assert cal.gradient_checkpointing  # TRL's default, kept by the module
    spec = ModelSpec.from_config(cal.config, seconds=cal.cost, fixed_s=cal.intercept_s)
    hw = Hardware(flops=1.0, gpus_per_node=1, intra_bw=1e30, inter_bw=1e30)
    res = simulate([[[0], [1]]], np.array([100, 200]), spec, hw, "fsdp2")
    assert res.step_s == pytest.approx(float(cal.seconds(100) + cal.seconds(200)), rel=1e-12)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_module_without_cuda_says_so_and_fails(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.calibration", "--models", "tiny", "--lengths", "16,32,64"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd + ["--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 1
    assert "torch sees no CUDA device here; use --device cpu" in proc.stdout
    (entry,) = json.loads((tmp_path / "calibration.json").read_text())["models"]
    assert entry["fit"] is None and "torch sees no CUDA device" in entry["error"]
    with pytest.raises(CalibrationError, match="has no fit .*torch sees no CUDA device"):
        load_calibration(tmp_path, "tiny")


def test_cli_refuses_bad_arguments(capsys):
    from benchmarks.calibration.cli import main

    for argv, match in [
        (["--models", "qwen9"], "unknown ['qwen9']"),
        (["--lengths", "16,32"], "at least 3 distinct lengths"),
        (["--lengths", "16,32,x"], "comma-separated list"),
        (["--models", "qwen2.5-0.5b", "--lengths", "256,512,65536"], "beyond qwen2.5-0.5b's max_position_embeddings"),
        (["--attn", "flash"], "unknown 'flash'"),
        (["--repeats", "2", "--min-repeats", "3"], "--min-repeats <= --repeats"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(argv + ["--out", "unused"])
        assert exc.value.code == 2
        assert match in capsys.readouterr().err


def test_a_failed_fit_keeps_the_points_and_says_why(tmp_path):
    from benchmarks.calibration.cli import _add_fit

    entry = _entry("qwen2.5-1.5b", MODEL_CONFIGS["qwen2.5-1.5b"])
    for p, s in zip(entry["points"], np.linspace(3.0, 1.0, LENGTHS.size), strict=True):
        p["median_s"] = float(s)  # times that fall with the length
    assert _add_fit(entry) is None
    assert entry["fit"] is None and "do not grow with the length" in entry["fit_error"]
    path = _write(tmp_path / "calibration.json", entry)
    with pytest.raises(CalibrationError, match=r"has no fit \(fit_quadratic found no non-negative fit"):
        load_calibration(path, "qwen2.5-1.5b")
