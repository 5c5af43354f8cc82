"""`StepTimer`'s accounting on a hand-driven clock: busy is the microbatches' compute less the time blocked on peers
inside them, wait is the rest of the step (see tests/multiprocess/test_telemetry_slowed_rank.py for real runs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from odc_accelerate.integrations.trainer import timing


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    return clock


def _batch(tokens: int) -> dict:
    return {"input_ids": torch.ones(1, tokens, dtype=torch.long), "attention_mask": torch.ones(1, tokens)}


def test_busy_is_compute_less_blocked_time_and_wait_is_the_rest(clock):
    engine = SimpleNamespace(stats=SimpleNamespace(wait_s=0.0))  # what an ODCEngine exposes: seconds in barriers
    timer = timing.StepTimer(rank=0)
    timer.start(None, engine, [_batch(5), _batch(3)], clock.now)
    clock.now += 0.25  # fetching the step
    with timer.compute("cpu"):
        clock.now += 1.0
    with timer.compute("cpu"):
        clock.now += 2.0
        clock.now += 0.5  # a barrier inside the microbatch (a benchmark's per-hook sync)
        engine.stats.wait_s += 0.5
    clock.now += 0.75  # metric reduction, step-boundary barrier, optimizer
    engine.stats.wait_s += 0.4
    timer.end(engine, clock.now)
    out = timer.interval_metrics(None, "cpu", per_rank=True)
    step = 0.25 + 1.0 + 2.5 + 0.75
    assert out["odc/step_s"] == pytest.approx(step)
    assert out["odc/busy_s_rank0"] == pytest.approx(3.0)
    assert out["odc/wait_s_rank0"] == pytest.approx(step - 3.0)
    assert out["odc/bubble_pct"] == pytest.approx(round(100 * (1 - 3.0 / step), 2))
    assert out["odc/tokens_per_s"] == pytest.approx(round(8 / step, 1))
    assert timer.pending == []


def test_interval_takes_the_slowest_rank_and_counts_compute_outside_a_step_nowhere(clock):
    timer = timing.StepTimer(rank=0)
    with timer.compute("cpu"):  # no open step: ignored
        clock.now += 9.0
    for compute in (1.0, 3.0):
        timer.start(None, None, [_batch(4)], clock.now)
        with timer.compute("cpu"):
            clock.now += compute
        clock.now += 1.0
        timer.end(None, clock.now)
    timer.end(None, clock.now + 5.0)  # no open step: ignored
    # A peer whose two steps took 10 s of which 7 s compute: rows are [step_s, busy_s, mb_min, mb_max, tokens,
    # generation_s, peak memory in MiB].
    peer = torch.tensor([[10.0, 7.0, 1.0, 1.0, 8.0, 0.0, 900.0]], dtype=torch.float64)
    out = timer.interval_metrics(lambda row: torch.cat([row, peer]), "cpu", per_rank=True)
    assert out["odc/step_s"] == pytest.approx(5.0)  # the slowest rank's interval over 2 steps
    assert (out["odc/busy_s_rank0"], out["odc/wait_s_rank0"]) == pytest.approx((4.0, 6.0))
    assert (out["odc/busy_s_rank1"], out["odc/wait_s_rank1"]) == pytest.approx((7.0, 3.0))
    assert out["odc/bubble_pct"] == pytest.approx(100 * (1 - 5.5 / 10.0))
    assert out["odc/tokens_per_s"] == pytest.approx(16 / 10.0)
    assert not any(key.startswith("odc/generation_s") for key in out)  # trainers that do not generate
    # each rank's peak memory: this process's resident set (no engine: read directly), the peer's as sent
    assert out["odc/peak_mem_mb_rank1"] == 900.0 and out["odc/peak_mem_mb_max"] >= 900.0
    assert 10 < out["odc/peak_mem_mb_rank0"] == pytest.approx(timing._peak_memory_mb(None), rel=0.1)
    # the summaries over ranks: rank 0 busy 4 / wait 6, rank 1 busy 7 / wait 3
    assert (out["odc/busy_s_min"], out["odc/busy_s_max"], out["odc/busy_s_mean"]) == pytest.approx((4.0, 7.0, 5.5))
    assert (out["odc/wait_s_min"], out["odc/wait_s_max"], out["odc/wait_s_mean"]) == pytest.approx((3.0, 6.0, 4.5))


def test_per_rank_keys_only_when_asked(clock):
    peer = torch.tensor([[10.0, 7.0, 1.0, 1.0, 8.0, 0.0, 900.0]], dtype=torch.float64)
    timer = timing.StepTimer(rank=0)
    timer.start(None, None, [_batch(4)], clock.now)
    with timer.compute("cpu"):
        clock.now += 2.0
    timer.end(None, clock.now)
    out = timer.interval_metrics(lambda row: torch.cat([row, peer]), "cpu")
    assert not [key for key in out if "_rank" in key]
    assert (out["odc/busy_s_min"], out["odc/busy_s_max"]) == pytest.approx((2.0, 7.0))
    assert (out["odc/wait_s_min"], out["odc/wait_s_max"]) == pytest.approx((3.0, 8.0))  # step: the slowest, 10 s


def test_generation_is_busy_once_and_reported_per_rank(clock):
    """A step of an RL trainer: generation (with a nested forward), then work known only afterwards."""
    timer = timing.StepTimer(rank=0)
    timer.start(None, None, [], clock.now)
    with timer.generation("cpu"):
        clock.now += 2.0
        with timer.compute("cpu"):  # a forward inside generate: already timed by the enclosing block
            clock.now += 1.0
    clock.now += 0.5  # scoring, waiting for peers: not busy
    with timer.compute("cpu"):  # a reference forward after generation
        clock.now += 0.25
    timer.add_work(microbatches=3, tokens=40)
    with timer.compute("cpu"):
        clock.now += 1.0
    clock.now += 0.25
    timer.end(None, clock.now)
    peer = torch.tensor([[5.0, 2.0, 1.0, 1.0, 10.0, 1.5, 900.0]], dtype=torch.float64)
    out = timer.interval_metrics(lambda row: torch.cat([row, peer]), "cpu", per_rank=True)
    assert out["odc/busy_s_rank0"] == pytest.approx(3.0 + 0.25 + 1.0)
    assert out["odc/wait_s_rank0"] == pytest.approx(5.0 - 4.25)
    assert (out["odc/generation_s_rank0"], out["odc/generation_s_rank1"]) == pytest.approx((3.0, 1.5))
    assert (out["odc/generation_s_min"], out["odc/generation_s_max"]) == pytest.approx((1.5, 3.0))
    assert (out["odc/microbatches_min"], out["odc/microbatches_max"]) == (1, 3)
    assert out["odc/tokens_per_s"] == pytest.approx(50 / 5.0)
