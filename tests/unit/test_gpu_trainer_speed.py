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
