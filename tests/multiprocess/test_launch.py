"""`odc_accelerate.testing.launch`: ranks forked from its fork server see the caller's environment at the call, as
spawned ranks would; ``start_method`` picks a fresh interpreter where one is needed."""

from __future__ import annotations

import os

import pytest

from odc_accelerate.testing import launch


def _environment(rank: int, world_size: int, names: list[str]) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


def test_ranks_see_the_callers_environment_at_each_call(monkeypatch):
    names = ["ODC_TEST_LAUNCH_SET", "ODC_TEST_LAUNCH_REMOVED", "ODC_TEST_LAUNCH_ARG"]
    monkeypatch.setenv("ODC_TEST_LAUNCH_REMOVED", "before")
    assert launch(_environment, 2, names)[0]["ODC_TEST_LAUNCH_REMOVED"] == "before"  # the fork server runs from here
    monkeypatch.setenv("ODC_TEST_LAUNCH_SET", "1")
    monkeypatch.delenv("ODC_TEST_LAUNCH_REMOVED")
    for method in (None, "spawn"):
        seen = launch(_environment, 2, names, env={"ODC_TEST_LAUNCH_ARG": "x"}, start_method=method)
        assert seen == [{"ODC_TEST_LAUNCH_SET": "1", "ODC_TEST_LAUNCH_REMOVED": None, "ODC_TEST_LAUNCH_ARG": "x"}] * 2


def test_an_unknown_start_method_is_refused():
    with pytest.raises(ValueError, match="start_method must be 'forkserver' or 'spawn', not 'fork'"):
        launch(_environment, 2, [], start_method="fork")
