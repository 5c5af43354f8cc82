"""The distillation trainer's pieces without a launch: the refusals (vLLM under ODC, a head still sharded when TRL's
loss reads it), the teacher's preparation routed through the trainer's preparer, and the step's entropy from the
deferred gathers (a rank with no microbatch included)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from odc_accelerate._compat.trl import distillation as trl_distillation
from odc_accelerate.config import ODCConfig
from odc_accelerate.integrations.trainer.metrics import DeferredGather, reduce_step_metrics
from odc_accelerate.integrations.trl.distillation import (
    check_distillation_args,
    check_heads_unsharded,
    finalize_distillation_metrics,
)


def test_vllm_is_refused_under_odc_before_any_work_naming_the_setting():
    args = SimpleNamespace(use_vllm=True, vllm_mode="colocate")
    with pytest.raises(ValueError) as raised:
        check_distillation_args(args, ODCConfig(enable=True))
    message = str(raised.value)
    assert message.startswith("use_vllm=True is not supported for distillation with ODC")
    assert "Set --use_vllm false" in message and "or run without --odc" in message
    check_distillation_args(args, ODCConfig(enable=False))  # plain FSDP2: TRL's own vLLM path
    check_distillation_args(SimpleNamespace(use_vllm=False), ODCConfig(enable=True))


def test_a_head_still_sharded_when_trls_loss_reads_it_is_refused(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    check_heads_unsharded(torch.zeros(4, 2), torch.zeros(4, 3))  # gathered heads: plain tensors
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        sharded = distribute_tensor(torch.zeros(4, 2), init_device_mesh("cpu", (1,)), [Shard(0)])
        with pytest.raises(RuntimeError) as raised:
            check_heads_unsharded(torch.zeros(4, 2), sharded)
    finally:
        dist.destroy_process_group()
    message = str(raised.value)
    assert "still sharded" in message and "full_tensor()" in message
    assert "TRANSFORMER_BASED_WRAP" in message and "or run without --odc" in message


def test_the_teacher_is_prepared_by_the_trainers_preparer_within_the_block_only(monkeypatch):
    from accelerate import Accelerator

    accelerates = []

    def accelerate_prepare_model(self, model, device_placement=None, evaluation_mode=False):  # accelerate's, recorded
        accelerates.append((model, evaluation_mode))
        return f"accelerate's {model}"

    monkeypatch.setattr(Accelerator, "prepare_model", accelerate_prepare_model)
    routed = []

    def prepare(model, accelerator, trl_prepare):
        routed.append((model, accelerator))
        return f"sharded {model}", trl_prepare(model, accelerator)

    accelerator = object()
    with trl_distillation.teacher_preparer(prepare):
        # TRL's teacher call: routed, and TRL's own preparation is still at hand (accelerate's, for evaluation)
        assert Accelerator.prepare_model(accelerator, "teacher", evaluation_mode=True) == (
            "sharded teacher",
            "accelerate's teacher",
        )
        assert (
            Accelerator.prepare_model(accelerator, "student") == "accelerate's student"
        )  # for training: accelerate's
    assert routed == [("teacher", accelerator)]
    assert accelerates == [("teacher", True), ("student", False)]
    assert Accelerator.prepare_model is accelerate_prepare_model  # restored after the block


class _StandIn:
    """What the metrics read of TRL's DistillationTrainer: its recorded metrics."""

    def __init__(self, recorded):
        self._metrics = {"train": recorded}


def _microbatch(deferred, tokens: float, entropy_sum: float) -> None:
    """A microbatch's gathers as TRL's DistillationTrainer.compute_loss makes them, in its order."""
    deferred.start_microbatch()
    deferred(torch.tensor(tokens))
    deferred(torch.tensor(entropy_sum))


@pytest.mark.parametrize("idle_rank", [False, True])
def test_step_entropy_is_a_ratio_of_global_sums_not_a_mean_of_microbatch_ratios(idle_rank):
    assert trl_distillation.DISTILLATION_TRAIN_GATHERS == ("num_valid_tokens", "entropy_sum")
    deferreds = [DeferredGather(), DeferredGather()]
    _microbatch(deferreds[0], 30, 30 * 2.0)  # entropy 2 on 30 tokens
    if idle_rank:  # rank 1 runs no microbatch of this step; rank 0 the other too
        _microbatch(deferreds[0], 10, 10 * 6.0)
    else:
        _microbatch(deferreds[1], 10, 10 * 6.0)  # entropy 6 on 10 tokens
    rows = []
    for deferred in deferreds:
        reduce_step_metrics(deferred, lambda t, r=rows: r.append(t) or t, "cpu")
    for rank, deferred in enumerate(deferreds):
        metrics = reduce_step_metrics(deferred, lambda t: torch.cat(rows), "cpu")
        ran = len(deferred.calls)
        recorded = {"entropy": [5.0] + [0.0] * ran, "step_time": [1.0] * ran}  # an earlier step's value kept
        finalize_distillation_metrics(_StandIn(recorded), metrics)
        assert recorded["entropy"] == [5.0, pytest.approx(3.0)], rank  # (60 + 60) / 40, not (2 + 6) / 2
        assert recorded["step_time"] == ([float(ran)] if ran else []), rank
