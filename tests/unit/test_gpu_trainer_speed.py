"""The GPU Trainer speed case's figures (`tests.helpers.trainer_speed.summarize`): the median over an arm's runs, ODC's
step over its reference's, and the profiled step's top ops kept only where ODC is more than 5% over."""

from __future__ import annotations

import pytest

from tests.helpers.trainer_speed import PROFILE_OVER, summarize


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
