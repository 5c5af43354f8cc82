"""The step's metric exchange (`reduce_step_metrics`) on two ranks emulated by threads: a microbatch over the limit of
deferred gathers raises on every rank after the one exchange, including a rank that ran no microbatch; none waits."""

from __future__ import annotations

import threading

import pytest
import torch

from odc_accelerate.integrations.trainer.metrics import MAX_GATHERS_PER_MICROBATCH, DeferredGather, reduce_step_metrics


def _exchange(world: int, timeout: float = 20.0):
    """An ``accelerator.gather`` for ``world`` threads: every rank's row, once all have sent one (a rank that never
    sends leaves the others with `threading.BrokenBarrierError` after ``timeout``, where processes would hang)."""
    rows: list[torch.Tensor | None] = [None] * world
    barrier = threading.Barrier(world, timeout=timeout)

    def gather_for(rank: int):
        def gather(row: torch.Tensor) -> torch.Tensor:
            rows[rank] = row
            barrier.wait()
            return torch.cat(rows)

        return gather

    return gather_for


def _run_ranks(deferreds: list[DeferredGather], timeout: float = 20.0) -> list[BaseException | object]:
    gather_for = _exchange(len(deferreds), timeout)
    results: list[BaseException | object] = [None] * len(deferreds)

    def rank(r: int) -> None:
        try:
            results[r] = reduce_step_metrics(deferreds[r], gather_for(r), "cpu")
        except BaseException as error:  # noqa: BLE001 - reported to the test
            results[r] = error

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(deferreds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    assert not any(t.is_alive() for t in threads)
    return results


def test_too_many_gathers_raise_on_every_rank_after_the_exchange_even_one_without_a_microbatch():
    busy, idle = DeferredGather(), DeferredGather()  # rank 1 ran no microbatch this step
    busy.start_microbatch()
    for _ in range(MAX_GATHERS_PER_MICROBATCH + 1):
        busy(torch.tensor([1.0]))
    results = _run_ranks([busy, idle], timeout=10.0)
    for rank, result in reversed(list(enumerate(results))):  # the idle rank first: it is the one that waited
        assert not isinstance(result, threading.BrokenBarrierError), rank  # it waited for a peer that had raised
        assert isinstance(result, RuntimeError), (rank, result)
        message = str(result)
        assert message.startswith(
            f"ODC defers at most {MAX_GATHERS_PER_MICROBATCH} metric gathers per microbatch, but a microbatch made "
            f"{MAX_GATHERS_PER_MICROBATCH + 1} (on rank 0)"
        ), message
        assert "Gather fewer per microbatch, or run without --odc / --odc_plan." in message


def test_within_the_limit_both_ranks_get_the_step_values():
    busy, idle = DeferredGather(), DeferredGather()
    busy.start_microbatch()
    for value in range(MAX_GATHERS_PER_MICROBATCH):
        busy(torch.tensor([float(value)]))
    results = _run_ranks([busy, idle])
    for result in results:
        assert result.gathers_per_microbatch == MAX_GATHERS_PER_MICROBATCH and result.global_microbatches == 1
        assert result.global_sums[:3] == [0.0, 1.0, 2.0]


def test_a_single_process_raises_too():
    deferred = DeferredGather()
    deferred.start_microbatch()
    for _ in range(MAX_GATHERS_PER_MICROBATCH + 2):
        deferred(torch.tensor([1.0]))
    with pytest.raises(RuntimeError, match="but a microbatch made 34 "):
        reduce_step_metrics(deferred, None, "cpu")
