"""``python -m benchmarks.sim validate-e2e``: replaying recorded steps through the simulator, the step trace it reads
and the stored results it is calibrated on. Pure Python / numpy: the live calibrations are exercised by the CLI on a
real benchmark run, not here."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks.sim import Hardware, ModelSpec, simulate
from benchmarks.sim.calibrate import cpu_hardware
from benchmarks.sim.cli import main as sim_main
from benchmarks.sim.replay import calibrate_flops, fit_fixed_per_group, step_plans, validate_e2e
from benchmarks.sim.results import E2E_SFT_RESULTS, load_e2e_result, load_engine_result, load_shm_figures
from odc_accelerate.config import ODCConfig
from odc_accelerate.telemetry import StepTrace, microbatch_shape

MODEL = ModelSpec(layers=2, hidden=64, intermediate=256, heads=4, kv_heads=2, vocab=1000, param_bytes=4, grad_bytes=4)
SHM = {"read_MBps": 20000.0, "acc_MBps": 10000.0, "read_us": 2.0, "acc_us": 3.0, "barrier_us": 20.0}
GLOO = {"ag_fit": (2e-4, 1.5e9), "rs_fit": (3e-4, 1.0e9)}


def test_microbatch_shape_padded_and_packed():
    padded = {
        "input_ids": torch.zeros(3, 7, dtype=torch.long),
        "attention_mask": torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5]),
    }
    assert microbatch_shape(padded) == {"rows": 3, "width": 7, "row_tokens": [7, 4, 2]}
    packed = {
        "input_ids": torch.zeros(1, 9, dtype=torch.long),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]),
    }
    assert microbatch_shape(packed) == {"rows": 1, "width": 9, "row_tokens": [9], "segments": [3, 2, 4]}
    assert microbatch_shape({"pixel_values": torch.zeros(2)})["rows"] == 0


def test_step_trace_writes_one_line_per_step(tmp_path):
    # the end-to-end benchmark asks for the trace through the environment
    assert ODCConfig.from_sources(env={}).trace_dir is None
    assert ODCConfig.from_sources(env={"ODC_TRACE_DIR": str(tmp_path / "t")}).trace_dir == str(tmp_path / "t")
    trace = StepTrace(str(tmp_path / "t"), 3)
    trace.record([{"rows": 1, "width": 5, "row_tokens": [5]}], 2.0, 1.5, 0.5)
    trace.record([], 1.0, 1.0, 0.0)
    rows = [json.loads(line) for line in (tmp_path / "t" / "trace_rank3.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["microbatches"][0]["width"] == 5
    assert rows[0]["busy_s"] + rows[0]["wait_s"] == rows[0]["step_s"]
    StepTrace(str(tmp_path / "t"), 3)  # a rerun into the same folder starts over
    assert (tmp_path / "t" / "trace_rank3.jsonl").read_text() == ""


def _shape(widths: list[int]) -> dict:
    return {"rows": len(widths), "width": max(widths), "row_tokens": widths}


def _trace_from(plans: list[list[list[list[int]]]], step_s: list[float]) -> list[list[dict]]:
    """trace[rank][step] of plans whose microbatches are lists of row widths (each row padded to the widest)."""
    world = len(plans[0])
    return [
        [
            {"step": s + 1, "step_s": step_s[s], "microbatches": [_shape(mb) for mb in plan[r]]}
            for s, plan in enumerate(plans)
        ]
        for r in range(world)
    ]


def _sim_step(plan_widths, hw, system) -> float:
    ((plan, lengths, _, _),) = step_plans(_trace_from([plan_widths], [0.0]), 0)
    # as the runs do (and validate_e2e assumes): gradients reduced in each rank's last microbatch only
    return simulate(plan, lengths, MODEL, hw, system, accumulate_locally=True).step_s


def test_replay_predicts_runs_generated_by_the_same_model_exactly():
    """Runs whose 'measured' times come from the simulator with known hardware: calibration recovers the FLOP/s and
    the per-group overheads, and every arm is predicted with zero error (the replay indexes rows as the trace has them).
    """
    flops = 3e9
    base = cpu_hardware(flops, GLOO, SHM, 2)
    true = {"fsdp2": base.with_(fixed_per_group=4e-3), "odc": base.with_(fixed_per_group=1e-3)}
    steps = {
        "fsdp2_random": [[[[300]], [[40]]], [[[90]], [[500]]]],  # rank -> microbatches -> row widths
        "fsdp2_lockstep": [[[[300, 40]], [[90, 90]]], [[[500]], [[120, 200]]]],
        "odc": [[[[300], [40, 40]], [[90]]], [[[500]], [[120], [200], [30]]]],
    }
    runs = {}
    for name, plans in steps.items():
        system = "odc" if name == "odc" else "fsdp2"
        times = [_sim_step(p, true[system], system) for p in plans]
        warm = [plans[0], *plans]  # first step dropped as warm-up
        runs[name] = [{"trace": [_trace_from(warm, [99.0, *times])]}]
    # limit: 2 processes, each the whole global step on one rank, no communication
    limit_steps = [[[mb for rank in p for mb in rank]] for p in steps["odc"]]
    limit_times = [
        _sim_step(p, base.with_(intra_bw=1e30, inter_bw=1e30, p2p_intra_bw=1e30, p2p_lat=0.0, barrier_lat=0.0), "odc")
        for p in limit_steps
    ]
    limit_trace = _trace_from([limit_steps[0], *limit_steps], [99.0, *limit_times])
    runs["limit"] = [{"trace": [limit_trace, limit_trace]}]
    assert calibrate_flops(runs["limit"], MODEL, 1) == pytest.approx(flops, rel=1e-9)

    one_mb = [[[0]], [[0]]]
    comm = {f"{s}_comm": _sim_step(one_mb, true[s].with_(barrier_lat=0.0), s) for s in ("fsdp2", "odc")}
    for s in ("fsdp2", "odc"):
        assert fit_fixed_per_group(MODEL, base, 2, s, comm[f"{s}_comm"]) == pytest.approx(true[s].fixed_per_group)

    result = {"config": {"world_size": 2, "warmup": 1}, "runs": runs}
    res = validate_e2e(result, MODEL, GLOO, SHM, comm)
    assert set(res["rows"]) == {"fsdp2_random", "fsdp2_lockstep", "odc"}
    for row in res["rows"].values():
        assert row["error_pct"] == pytest.approx(0.0, abs=1e-6)
    assert res["max_abs_error_pct"] == pytest.approx(0.0, abs=1e-6)
    # tokens/s ratios: real tokens over (predicted) step times, the same figure measured and predicted here
    for v in res["speedups"].values():
        assert v["predicted"] == pytest.approx(v["measured"])
    # and a wrong calibration shows: FSDP2 communication overstated -> FSDP2 arms over-predicted, ODC unchanged
    wrong = validate_e2e(result, MODEL, GLOO, SHM, dict(comm, fsdp2_comm=2 * comm["fsdp2_comm"]))["rows"]
    assert wrong["fsdp2_random"]["error_pct"] > 1.0 and wrong["fsdp2_lockstep"]["error_pct"] > 1.0
    assert wrong["odc"]["error_pct"] == pytest.approx(0.0, abs=1e-6)
    # the same ODC run stored as the `grads` arm (what the replay models) is predicted as ODC, with its own speedups
    renamed = dict(runs, odc_grads=runs["odc"])
    del renamed["odc"]
    grads = validate_e2e(dict(result, runs=renamed), MODEL, GLOO, SHM, comm)
    assert set(grads["rows"]) == {"fsdp2_random", "fsdp2_lockstep", "odc_grads"}
    assert grads["rows"]["odc_grads"] == res["rows"]["odc"]
    assert set(grads["speedups"]) == {"odc_grads_vs_fsdp2_random", "odc_grads_vs_fsdp2_lockstep"}


def test_replay_refuses_runs_without_trace_or_limit():
    with pytest.raises(ValueError, match="ODC_TRACE_DIR"):
        step_plans([], 0)
    with pytest.raises(ValueError, match="reference-model forwards"):
        validate_e2e({"config": {"world_size": 2, "warmup": 1, "workload": "dpo"}, "runs": {}}, MODEL, GLOO, SHM, {})
    with pytest.raises(ValueError, match="--no_limit"):
        validate_e2e({"config": {"world_size": 2, "warmup": 1}, "runs": {"odc": []}}, MODEL, GLOO, SHM, {})


def test_padded_rows_cost_their_width():
    """A microbatch of rows [300, 40] padded to 300 costs two rows of 300 (the model runs on the padding)."""
    ((plan, lengths, _, real),) = step_plans(_trace_from([[[[300, 40]], [[10]]]], [1.0]), 0)
    assert lengths.tolist() == [300.0, 300.0, 10.0] and real == 350
    assert plan == [[[0, 1]], [[2]]]
    assert np.isclose(
        simulate(
            plan, lengths, MODEL, Hardware(flops=1.0, gpus_per_node=2, intra_bw=1e30, inter_bw=1e30), "odc"
        ).busy_s[0],
        simulate(
            [[[0, 1]]],
            np.array([300.0, 300.0]),
            MODEL,
            Hardware(flops=1.0, gpus_per_node=1, intra_bw=1e30, inter_bw=1e30),
            "odc",
        ).busy_s[0],
    )


def test_stored_results_are_read_from_the_benchmarks_files(tmp_path):
    transport = {
        "benchmark": "transport",
        "repeats": 3,
        "results": {
            "shm": {
                "read_1MiB_MBps": 40000.0,
                "read_16MiB_MBps": 16000.0,
                "acc_1MiB_MBps": 30000.0,
                "acc_16MiB_MBps": 19000.0,
                "read_latency_us": 1.5,
                "acc_latency_us": 2.5,
                "barrier_latency_us": 20.0,
            }
        },
    }
    (tmp_path / "results.json").write_text(json.dumps(transport))
    expected = {"read_MBps": 40000.0, "acc_MBps": 30000.0, "read_us": 1.5, "acc_us": 2.5, "barrier_us": 20.0}
    assert load_shm_figures(tmp_path) == expected  # a folder means its results.json
    # a saved console output of a benchmark: the last JSON line is the summary
    (tmp_path / "engine.txt").write_text('table\n{"odc_balanced_ms": 1.0}\n{"odc_balanced_ms": 2.0}\n')
    assert load_engine_result(tmp_path / "engine.txt") == {"odc_balanced_ms": 2.0}
    # the stored end-to-end result (validate-e2e's default) has the step traces the replay needs
    assert E2E_SFT_RESULTS.parent.name == "sft_grads" and E2E_SFT_RESULTS.parent.parent.name == "e2e"
    stored = load_e2e_result()
    assert stored["config"]["workload"] == "sft" and stored["runs"]["limit"][0]["trace"]


def test_a_missing_stored_result_names_the_command_that_writes_it(tmp_path, capsys):
    for load, command in (
        (load_engine_result, "python -m benchmarks.engine"),
        (load_shm_figures, "python -m benchmarks.transport"),
        (load_e2e_result, "python -m benchmarks.e2e sft"),
    ):
        with pytest.raises(FileNotFoundError, match=f"run `{command}`"):
            load(tmp_path / "missing.json")
    engine = tmp_path / "engine.json"
    engine.write_text(json.dumps({"config": {}}))
    with pytest.raises(SystemExit) as exit_info:
        sim_main(["validate", "--engine-json", str(engine), "--transport-json", str(tmp_path / "none.json")])
    assert exit_info.value.code == 2
    assert "run `python -m benchmarks.transport`" in capsys.readouterr().err
