"""Plain FSDP2 on the lockstep plan: an unavoidable empty slot runs as a zero-weight microbatch (`StepCollator`,
`ZeroWeightMicrobatch`, the step loop's zero-weight backward and the metrics that leave it out)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from odc_accelerate.integrations.trainer.data import StepCollator, ZeroWeightMicrobatch
from odc_accelerate.integrations.trainer.metrics import DeferredGather, reduce_step_metrics
from odc_accelerate.integrations.trainer.step import _weighted, _zero_weight
from odc_accelerate.planning.lockstep import plan_lockstep


def _collate(rows: list[dict]) -> dict:
    return {"input_ids": torch.tensor([r["ids"] for r in rows])}


def test_five_full_samples_on_two_ranks_leave_one_slot_empty():
    # 5 samples of 128 tokens, a 128-token budget: one sample per microbatch, 3 slots per rank, 6 slots for 5 samples
    plan = plan_lockstep(np.ones(5), np.full(5, 128), world=2, budget=128)
    assert [len(p) for p in plan] == [3, 3]
    assert sorted(len(mb) for p in plan for mb in p) == [0, 1, 1, 1, 1, 1]


def test_an_empty_slot_is_dropped_or_becomes_a_zero_weight_copy_of_a_sample_of_the_rank():
    step = [[{"ids": [1, 2]}, {"ids": [3, 4]}], [], [{"ids": [5, 6]}]]
    assert [mb["input_ids"].tolist() for mb in StepCollator(_collate)(step)] == [[[1, 2], [3, 4]], [[5, 6]]]
    padded = StepCollator(_collate, pad_empty=True)(step)
    assert len(padded) == 3 and not isinstance(padded[0], ZeroWeightMicrobatch)
    assert isinstance(padded[1], ZeroWeightMicrobatch)
    assert padded[1].batch["input_ids"].tolist() == [[5, 6]]  # the last sample of the rank's last microbatch
    assert [mb["input_ids"].tolist() for mb in _weighted(padded)] == [[[1, 2], [3, 4]], [[5, 6]]]
    full = [[{"ids": [1]}], [{"ids": [2]}]]
    assert not any(isinstance(mb, ZeroWeightMicrobatch) for mb in StepCollator(_collate, pad_empty=True)(full))
    with pytest.raises(RuntimeError, match="no sample"):
        StepCollator(_collate, pad_empty=True)([[], []])


class _Accelerator:
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        loss.backward(**kwargs)


def test_a_zero_weight_microbatch_adds_exact_zeros_to_the_gradient():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    x, extra = torch.randn(3, 8), torch.randn(2, 8) * 100
    accelerator = _Accelerator()
    accelerator.backward(layer(x).pow(2).sum())
    expected = [p.grad.clone() for p in layer.parameters()]
    with _zero_weight(accelerator):
        accelerator.backward(layer(extra).pow(2).sum())
    assert "backward" not in vars(accelerator)  # the accelerator's own method again
    for p, g in zip(layer.parameters(), expected, strict=True):
        assert torch.equal(p.grad, g)


def test_zero_weight_records_count_locally_but_not_in_the_step_metrics():
    deferred = DeferredGather()
    deferred.start_microbatch()
    deferred(torch.tensor([1.0, 2.0]))
    deferred.start_microbatch(zero_weight=True)
    deferred(torch.tensor([10.0, 20.0]))
    metrics = reduce_step_metrics(deferred, None, "cpu", slots=2)
    # global: the real microbatch only; local: what the trainer counted as it went (both), for its running totals
    assert metrics.global_sums[0] == 3.0 and metrics.global_counts[0] == 2.0
    assert metrics.global_mins[0] == 1.0 and metrics.global_maxs[0] == 2.0
    assert metrics.local_sums[0] == 33.0
    assert (metrics.local_microbatches, metrics.global_microbatches, metrics.gathers_per_microbatch) == (2, 1, 1)
    nothing = DeferredGather()
    nothing.start_microbatch(zero_weight=True)
    metrics = reduce_step_metrics(nothing, None, "cpu", slots=2)
    assert (metrics.local_microbatches, metrics.global_microbatches) == (1, 0)
