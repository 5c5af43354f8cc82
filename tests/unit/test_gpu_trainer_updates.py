"""The GPU Trainer check's parity measure (`tests.gpu.gpu_trainer.compare_updates`): weight updates against the
reference's, relative to the update's norm, and every tensor moved, on weight dumps written as the runs write them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.gpu_trainer import compare_updates

START = {"w": torch.full((4, 4), 10.0), "norm": torch.ones(4)}


def _run(folder: Path, start: dict, final: dict) -> Path:
    folder.mkdir()
    torch.save(start, folder / "initial_params.pt")
    torch.save(final, folder / "final_params.pt")
    return folder


def _step(update: dict[str, float]) -> dict[str, torch.Tensor]:
    return {k: v + update.get(k, 0.0) for k, v in START.items()}


def test_a_wrong_update_is_caught_even_when_it_is_small_against_the_weights(tmp_path):
    # The update is 1e-3 of the weights: half of it wrong is 5e-5 of the weights, within any bound relative to them,
    # and half of the update relative to the update.
    ref = _run(tmp_path / "ref", START, _step({"w": -0.01, "norm": 0.001}))
    odc = _run(tmp_path / "odc", START, _step({"w": -0.005, "norm": 0.001}))
    out = compare_updates(odc, ref)
    assert out["same_start"] and out["unmoved"] == []
    # over every tensor: |0.005| x 4 over the norm of both tensors' reference updates (w's and norm's)
    assert out["update_rel"] == pytest.approx(0.02 / (16 * 0.01**2 + 4 * 0.001**2) ** 0.5, rel=1e-3)
    assert out["update_max_rel_per_tensor"] == pytest.approx(0.5, rel=1e-3)  # w's own


def test_the_same_updates_compare_equal(tmp_path):
    final = _step({"w": -0.01, "norm": 0.001})
    out = compare_updates(_run(tmp_path / "odc", START, final), _run(tmp_path / "ref", START, final))
    assert out == {"same_start": True, "unmoved": [], "update_rel": 0.0, "update_max_rel_per_tensor": 0.0}


def test_a_tensor_that_did_not_move_on_either_side_is_named(tmp_path):
    # Equal on both sides, so the differences are 0.0: which says nothing about "norm"'s gradient.
    ref = _run(tmp_path / "ref", START, _step({"w": -0.01}))
    odc = _run(tmp_path / "odc", START, _step({"w": -0.01, "norm": 0.001}))
    assert compare_updates(odc, ref)["unmoved"] == ["norm"]
    assert compare_updates(ref, ref)["unmoved"] == ["norm"]


def test_runs_from_different_starts_are_told_apart(tmp_path):
    other = {k: v + 1 for k, v in START.items()}
    ref = _run(tmp_path / "ref", START, _step({"w": -0.01, "norm": 0.001}))
    odc = _run(tmp_path / "odc", other, {k: v - 0.01 for k, v in other.items()})
    assert compare_updates(odc, ref)["same_start"] is False
