"""The GPU Trainer speed case (`tests.gpu.trainer_speed`): its figures (`summarize`: the median over an arm's runs,
ODC's step over its reference's, the profiled step's top ops kept only where ODC is more than 5% over) and its
schedule (every arm once, then each pair again while its runs fit in the budget), on a fake clock."""

from __future__ import annotations

import types

import pytest

from tests.gpu.trainer_speed import PROFILE_OVER, summarize


def _run(step_s: float | None, tag: str) -> dict:
    profile = {"step": 9, "sorted_by": "self_device_time_total", "top": [{"op": tag}], "table": tag, "rank": 0}
    run = {"ok": step_s is not None, "processes": [{"profile": profile}]}
    if step_s is not None:
        run["step_s"] = step_s
    return run


def test_medians_ratios_and_profiles_where_odc_is_over():
    result = {
        "runs": {
            "odc2": [_run(1.3, "odc2-a"), _run(1.1, "odc2-b"), _run(1.2, "odc2-c")],
            "limit2": [_run(1.0, "limit2-a"), _run(1.0, "limit2-b"), _run(1.0, "limit2-c")],
            "odc1": [_run(1.02, "odc1-a"), _run(None, "odc1-failed")],  # a failed run has no figure
            "limit1": [_run(1.0, "limit1-a")],
        }
    }
    summarize(result)
    assert result["median_step_s"] == pytest.approx({"odc2": 1.2, "limit2": 1.0, "odc1": 1.02, "limit1": 1.0})
    assert result["ratios"] == pytest.approx({"odc2_over_limit2": 1.2, "odc1_over_limit1": 1.02})
    # 1.2 > 1 + PROFILE_OVER: both sides' last profiled run; 1.02 is within it: none
    assert PROFILE_OVER == 0.05
    assert set(result["profiles"]) == {"odc2", "limit2"}
    assert (
        result["profiles"]["odc2"]["top"] == [{"op": "odc2-c"}] and result["profiles"]["limit2"]["table"] == "limit2-c"
    )
    assert "rank" not in result["profiles"]["odc2"]


def test_an_arm_without_a_finished_run_has_no_median_and_no_ratio():
    result = {"runs": {"odc2": [_run(None, "x")], "limit2": [_run(1.0, "y")], "odc1": [], "limit1": []}}
    summarize(result)
    assert result["median_step_s"] == {"limit2": 1.0} and result["ratios"] == {} and result["profiles"] == {}


def test_arms_interleave_and_pairs_repeat_while_their_runs_fit(monkeypatch, tmp_path):
    # every run takes 10 s of a fake clock: a round of 4 runs is 40 s, a pair 20 s
    from tests.gpu import trainer_speed

    clock = [0.0]
    order = []

    def run_arm(arm, device, settings, model, run_dir, timeout, logs):
        order.append(arm)
        clock[0] += 10.0
        transports = ["CudaTransport"] * int(arm[-1]) if arm.startswith("odc") else None
        return {"arm": arm, "ok": True, "step_s": 1.0, "processes": [], "transports": transports}

    monkeypatch.setattr(trainer_speed, "run_arm", run_arm)
    monkeypatch.setattr(trainer_speed, "build_model", lambda device, path: {"parameters": 1})
    monkeypatch.setattr(trainer_speed, "machine", lambda device: {"device": device})
    monkeypatch.setattr(trainer_speed, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    # round one takes 40 s; a pair runs again where 1.2 x its last 20 s is left: the 2-rank pair (43 s left), then
    # not the 1-rank pair (23 s left), nor any pair in the third round
    out = trainer_speed.case_speed("cuda", tmp_path, tmp_path, [], budget_s=40 + 20 + 23)
    assert order == ["odc2", "limit2", "odc1", "limit1", "odc2", "limit2"]
    assert out["repeats_run"] == {"odc2": 2, "limit2": 2, "odc1": 1, "limit1": 1}
    assert all(out["checks"].values()) and (tmp_path / "trainer_speed.json").exists()


def _fake_schedule(monkeypatch, run_s: float) -> list[str]:
    """`case_speed` with every run taking ``run_s`` of a fake clock; the arms in the order they ran."""
    from tests.gpu import trainer_speed

    clock = [0.0]
    order: list[str] = []

    def run_arm(arm, device, settings, model, run_dir, timeout, logs):
        order.append(arm)
        clock[0] += run_s
        transport = "CudaTransport" if device == "cuda" else "ShmTransport"
        transports = [transport] * int(arm[-1]) if arm.startswith("odc") else None
        return {"arm": arm, "ok": True, "step_s": 1.0, "processes": [], "transports": transports}

    monkeypatch.setattr(trainer_speed, "run_arm", run_arm)
    monkeypatch.setattr(trainer_speed, "build_model", lambda device, path: {"parameters": 1})
    monkeypatch.setattr(trainer_speed, "machine", lambda device: {"device": device})
    monkeypatch.setattr(trainer_speed, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    return order


def test_the_cpu_dry_run_runs_every_arm_once_whatever_the_time_left(monkeypatch, tmp_path):
    # a loaded machine: each run takes 100 s against a 30 s budget; on CPU the runs are fixed, so every arm still
    # runs, once (on a GPU the 1-rank pair would be left out when the time is gone)
    from tests.gpu import trainer_speed

    order = _fake_schedule(monkeypatch, run_s=100.0)
    out = trainer_speed.case_speed("cpu", tmp_path, tmp_path, [], budget_s=30)
    assert order == list(trainer_speed.ARMS)
    assert out["repeats_run"] == dict.fromkeys(trainer_speed.ARMS, 1) and all(out["checks"].values())
    # the same clock on a GPU: the budget decides
    order.clear()
    out = trainer_speed.case_speed("cuda", tmp_path, tmp_path, [], budget_s=30)
    assert order == ["odc2", "limit2"] and not all(out["checks"].values())


def test_the_cpu_dry_runs_are_three_steps_of_few_tokens(tmp_path):
    # the tiny model keeps the tokenizer's 151,936-token vocabulary: a CPU step's time goes with its microbatches (the
    # head's work over the whole vocabulary) and its tokens; a sample is at most one microbatch
    from tests.gpu import trainer_speed

    settings = trainer_speed.SETTINGS["cpu"]
    for arm in trainer_speed.ARMS:
        (tmp_path / arm).mkdir()  # an ODC run's accelerate config is written there
        jobs = trainer_speed._jobs(arm, "cpu", settings, tmp_path / "model", tmp_path / arm)
        assert len(jobs) == (2 if arm == "limit2" else 1)
        for _, cmd, env in jobs:
            args = [str(c) for c in cmd]
            steps, samples, length = (int(args[args.index(name) + 1]) for name in
                                      ("--max_steps", "--odc_samples_per_step", "--max_length"))  # fmt: skip
            # warm-up, measured and the profiled step
            assert steps == 3 and env["ODC_BENCH_PROFILE_STEP"] == "3"
            assert samples <= 4 and samples * length <= 256, args
            assert "--use_cpu" in args
