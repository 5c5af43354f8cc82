"""Gather-only ODC engine (frozen models, e.g. DPO's reference): real 2-rank gloo processes on CPU."""

import numpy as np
import torch

from odc_accelerate.testing import launch
from odc_accelerate.testing.models import ToyConfig, build_model, make_steps, token_loss_sum
from tests.helpers.workers.engine_workers import frozen_forward, frozen_refuses_trainable

PLAN = [[12, 7, 9], []]  # rank 0 runs three forwards, rank 1 none: no rank waits for another


def test_frozen_engine_forwards_match_unsharded_model_without_collectives():
    results = launch(frozen_forward, 2, {"plan": PLAN}, timeout=120)
    model = build_model(ToyConfig(), seed=0)
    with torch.no_grad():
        expected = [
            float(token_loss_sum(model, ids)[0]) for ids in make_steps([PLAN], ToyConfig().vocab, seed=1)[0][0]
        ]
    np.testing.assert_allclose(results[0]["losses"], expected, rtol=1e-6)
    assert results[1]["losses"] == []
    for rank, res in enumerate(results):
        assert res["counts"] == {}, f"rank {rank} made torch.distributed calls: {res['counts']}"
        # published shards only: no gradient accumulators for a model that is never trained
        assert not any(name.startswith("g") for name in res["buffers"]), res["buffers"]
        assert any(name.startswith("p") for name in res["buffers"])
        for name in ("pre_optimizer_step", "post_optimizer_step"):
            assert "frozen" in res["errors"][name] and "republish" in res["errors"][name]
    assert results[0]["gathers"] > 0


def test_frozen_engine_refuses_trainable_parameters():
    messages = launch(frozen_refuses_trainable, 2, {}, timeout=120)
    for text in messages:
        assert "require grad" in text and "requires_grad_(False)" in text
