"""The accumulate-bandwidth crossover of the simulator (``python -m benchmarks.sim accumulate``) against a hand
calculation, and the DPO pairs it simulates."""

import numpy as np
import pytest

from benchmarks.sim import crossover
from benchmarks.sim.simulator import QWEN2_5_1_5B, Hardware, ModelSpec, simulate

GB = 1e9


def test_crossover_matches_a_hand_calculation():
    # Two ranks, one microbatch each, nothing overlapped, no latency: both systems pay the slowest rank's compute C.
    # FSDP2 adds an all-gather in each pass and a reduce-scatter, each (W-1)/W x 2 bytes x P at 10 GB/s: 3P/10 GB/s.
    # ODC adds two reads at 100 GB/s, 2P/100 GB/s, and one push of its gradients, P/B. ODC overtakes when
    # P/B = 3P/10 - 2P/100, i.e. at B = 1/0.28 = 3.571 GB/s, whatever P and C are.
    model = ModelSpec(layers=2, hidden=1024, intermediate=4096, heads=8, param_bytes=2, grad_bytes=2)
    hw = Hardware(
        flops=1e12, gpus_per_node=2, intra_bw=10 * GB, inter_bw=10 * GB, p2p_intra_bw=100 * GB, overlap=False
    )
    plan, lengths = [[[0]], [[1]]], np.array([1000, 3000])
    fsdp2 = simulate(plan, lengths, model, hw, "fsdp2").step_s

    def odc(gbps: float) -> float:
        return simulate(plan, lengths, model, hw.with_(p2p_acc_intra_bw=gbps * GB), "odc").step_s

    assert crossover.crossover_gbps(odc, fsdp2, lo=0.1, hi=1e4) == pytest.approx(1 / 0.28, rel=1e-3)
    # already faster at the lowest bandwidth tried: that bandwidth; slower even with a free accumulate: None
    assert crossover.crossover_gbps(odc, fsdp2, lo=10.0, hi=1e4) == 10.0
    compute = simulate(plan, lengths, model, hw, "odc").busy_s.max()
    assert crossover.crossover_gbps(odc, compute, lo=0.1, hi=1e4) is None


def test_dpo_pairs_are_padded_rows_each_planned_once():
    rng = np.random.default_rng(0)
    pairs = crossover.dpo_pair_lengths(rng, 10_000)
    assert pairs.min() >= 64 and pairs.max() <= 32768  # two padded rows of a pair fit one 64K-token microbatch
    assert np.median(pairs) > 4000  # a long prompt and the longer of two answers
    (step,) = crossover.workload_steps("dpo", QWEN2_5_1_5B, rng, steps=1, per_rank=4)
    assert step["lengths"].size == 2 * 8 * 4 and np.array_equal(step["lengths"][0::2], step["lengths"][1::2])
    for plan in step["plans"].values():
        rows = sorted(r for rank in plan for mb in rank for r in mb)
        assert rows == list(range(step["lengths"].size))  # every row once, both rows of a pair in one microbatch
        assert all(r + 1 in mb for rank in plan for mb in rank for r in mb if r % 2 == 0)


def test_the_reference_forward_of_dpo_costs_one_more_forward_and_its_gathers():
    # As above: the reference model's forward adds the slowest rank's forward (a third of its compute) and, for
    # FSDP2, one all-gather of 2 bytes x P x (W-1)/W at 10 GB/s; for ODC one read at 100 GB/s.
    model = ModelSpec(layers=2, hidden=1024, intermediate=4096, heads=8, param_bytes=2, grad_bytes=2)
    hw = Hardware(
        flops=1e12, gpus_per_node=2, intra_bw=10 * GB, inter_bw=10 * GB, p2p_intra_bw=100 * GB, overlap=False
    )
    plan, lengths = [[[0]], [[1]]], np.array([1000, 3000])
    base = simulate(plan, lengths, model, hw, "fsdp2")
    forward = base.busy_s.max() / 3
    with_reference = simulate(plan, lengths, model, hw, "fsdp2", reference_forward=True)
    assert with_reference.step_s - base.step_s == pytest.approx(forward + model.num_params / (10 * GB))
    assert with_reference.busy_s == pytest.approx(base.busy_s * 4 / 3)
    odc = simulate(plan, lengths, model, hw, "odc", reference_forward=True).step_s
    assert odc - simulate(plan, lengths, model, hw, "odc").step_s == pytest.approx(
        forward + model.num_params / (100 * GB)
    )
