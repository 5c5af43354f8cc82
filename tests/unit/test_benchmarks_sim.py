"""Invariants of the step-time simulator against independent hand computations (pure numpy, fast)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.sim import Hardware, ModelSpec, collective_time, one_sided_time, simulate
from benchmarks.sim.cli import main as sim_main
from odc_accelerate.planning import flops_cost, plan_from_costs

MODEL = ModelSpec(layers=4, hidden=64, intermediate=256, heads=4, vocab=128)
FAST = 1e30  # a bandwidth so high that communication costs nothing


def _hw(**kw) -> Hardware:
    base = dict(flops=1e9, gpus_per_node=8, intra_bw=FAST, inter_bw=FAST)
    return Hardware(**(base | kw))


def _flop(lengths) -> np.ndarray:
    m = MODEL
    return flops_cost(m.layers, m.hidden, m.intermediate, m.heads, m.kv_heads, m.vocab)(np.asarray(lengths))


def test_group_costs_sum_to_flops_cost():
    lin, quad, params = MODEL.group_costs()
    ref = _flop([1])[0] - _flop([0])[0]  # not used directly: compare coefficients instead
    cost = flops_cost(MODEL.layers, MODEL.hidden, MODEL.intermediate, MODEL.heads, None, MODEL.vocab)
    assert lin.sum() == pytest.approx(cost.linear)
    assert quad.sum() == pytest.approx(cost.quadratic)
    assert ref == pytest.approx(cost.linear + cost.quadratic)
    assert params.sum() == MODEL.num_params


def test_balanced_zero_comm_equals_compute():
    lengths = np.array([100, 300, 100, 300])
    plan = [[[0], [1]], [[2], [3]]]  # identical work on both ranks, slot by slot
    expected = _flop([100, 300]).sum() / 1e9
    for system in ("fsdp2", "odc"):
        for overlap in (True, False):
            res = simulate(plan, lengths, MODEL, _hw(overlap=overlap), system)
            assert res.step_s == pytest.approx(expected, rel=1e-9)
            assert res.limit_s == pytest.approx(expected, rel=1e-9)
            assert res.bubble_pct == pytest.approx(0.0, abs=1e-6)


def test_fsdp2_lockstep_is_sum_of_slot_maxima():
    lengths = np.array([50, 400, 200, 120, 10, 330])
    plan = [[[0], [1, 4]], [[2, 3], [5]]]
    per = np.array([[_flop([50]).sum(), _flop([400, 10]).sum()], [_flop([200, 120]).sum(), _flop([330]).sum()]])
    res = simulate(plan, lengths, MODEL, _hw(), "fsdp2")
    assert res.step_s == pytest.approx(per.max(axis=0).sum() / 1e9, rel=1e-9)
    odc = simulate(plan, lengths, MODEL, _hw(), "odc")
    assert odc.step_s == pytest.approx(per.sum(axis=1).max() / 1e9, rel=1e-9)
    assert odc.limit_s == pytest.approx(per.sum() / 2 / 1e9, rel=1e-9)


def test_odc_never_below_limit_and_fsdp2_never_below_odc_without_comm():
    rng = np.random.default_rng(0)
    for _ in range(20):
        world = int(rng.integers(2, 9))
        lengths = rng.integers(16, 4096, 4 * world)
        costs = _flop(lengths)
        for name in ("free", "lockstep"):
            plan = plan_from_costs(costs, lengths, world, 8192, plan=name)
            odc = simulate(plan, lengths, MODEL, _hw(), "odc")
            fsdp = simulate(plan, lengths, MODEL, _hw(), "fsdp2")
            assert odc.step_s >= odc.limit_s * (1 - 1e-12)
            assert fsdp.step_s >= odc.step_s * (1 - 1e-12)  # per-slot maxima sum >= max of per-rank sums
            assert np.all(fsdp.wait_s >= -1e-12) and np.all(odc.wait_s >= -1e-12)


def test_ring_collective_formula_and_bandwidth_scaling():
    hw = Hardware(flops=1e12, gpus_per_node=8, intra_bw=100e9, inter_bw=10e9, intra_lat=1e-6, inter_lat=5e-6)
    nbytes = 1e9
    # One node: (W-1)/W * bytes / intra_bw + (W-1) hops.
    assert collective_time(nbytes, 8, hw) == pytest.approx(7 / 8 * nbytes / 100e9 + 7 * 1e-6)
    # Four nodes: the inter-node link sets the pace; 3 inter-node hops and 7 intra-node hops.
    assert collective_time(nbytes, 32, hw) == pytest.approx(31 / 32 * nbytes / 10e9 + 3 * 5e-6 + 7 * 1e-6)
    assert collective_time(nbytes, 1, hw) == 0.0
    # Bandwidth term halves when bandwidth doubles.
    hw0 = hw.with_(intra_lat=0.0, inter_lat=0.0)
    assert collective_time(nbytes, 8, hw0.with_(intra_bw=200e9)) == pytest.approx(collective_time(nbytes, 8, hw0) / 2)
    # One-sided: local and remote parts run in parallel; contention scales the traffic.
    t = one_sided_time(nbytes, 32, hw0)
    assert t == pytest.approx(max(7 / 32 * nbytes / 100e9, 24 / 32 * nbytes / 10e9))
    assert one_sided_time(nbytes, 32, hw0.with_(contention=2.0)) == pytest.approx(2 * t)


def test_comm_without_overlap_adds_exactly():
    lengths = np.array([256, 256])
    plan = [[[0]], [[1]]]
    hw = _hw(intra_bw=1e9, overlap=False)
    _, _, params = MODEL.group_costs()
    ag = collective_time(params * MODEL.param_bytes, 2, hw)
    rs = collective_time(params * MODEL.grad_bytes, 2, hw)
    res = simulate(plan, lengths, MODEL, hw, "fsdp2")
    assert res.step_s == pytest.approx(_flop([256]).sum() / 1e9 + (2 * ag + rs).sum(), rel=1e-9)
    rd = one_sided_time(params * MODEL.param_bytes, 2, hw)
    acc = one_sided_time(params * MODEL.grad_bytes, 2, hw)
    odc = simulate(plan, lengths, MODEL, hw, "odc")
    assert odc.step_s == pytest.approx(_flop([256]).sum() / 1e9 + (2 * rd + acc).sum(), rel=1e-9)
    # With overlap, comm hides behind compute: never slower, never faster than either part alone.
    over = simulate(plan, lengths, MODEL, hw.with_(overlap=True), "fsdp2")
    assert _flop([256]).sum() / 1e9 <= over.step_s <= res.step_s


def test_local_accumulation_reduces_only_in_each_ranks_last_microbatch():
    # rank 0 runs 3 microbatches, rank 1 runs 1: with no_sync only the last backward of each rank reduces
    lengths = np.array([128, 128, 128, 384])
    plan = [[[0], [1], [2]], [[3]]]
    hw = _hw(intra_bw=1e9, overlap=False)
    _, _, params = MODEL.group_costs()
    ag, rs = (
        collective_time(params * MODEL.param_bytes, 2, hw).sum(),
        collective_time(params * MODEL.grad_bytes, 2, hw).sum(),
    )
    rd, acc = (
        one_sided_time(params * MODEL.param_bytes, 2, hw).sum(),
        one_sided_time(params * MODEL.grad_bytes, 2, hw).sum(),
    )
    f128, f384 = _flop([128]).sum() / 1e9, _flop([384]).sum() / 1e9
    # FSDP2: 3 lockstep slots (rank 1 joins the last two with no compute); 2 gathers per slot, 1 reduce at the end
    slots = max(f128, f384) + 2 * f128
    fsdp = simulate(plan, lengths, MODEL, hw, "fsdp2", accumulate_locally=True)
    assert fsdp.step_s == pytest.approx(slots + 3 * 2 * ag + rs, rel=1e-9)
    assert simulate(plan, lengths, MODEL, hw, "fsdp2").step_s == pytest.approx(slots + 3 * (2 * ag + rs), rel=1e-9)
    # ODC: each rank on its own, one accumulate per rank
    odc = simulate(plan, lengths, MODEL, hw, "odc", accumulate_locally=True)
    expected = max(3 * f128 + 3 * 2 * rd + acc, f384 + 2 * rd + acc)
    assert odc.step_s == pytest.approx(expected, rel=1e-9)
    every = max(3 * (f128 + 2 * rd + acc), f384 + 2 * rd + acc)
    assert simulate(plan, lengths, MODEL, hw, "odc").step_s == pytest.approx(every, rel=1e-9)


def test_uneven_microbatch_counts():
    # ODC allows ranks with different numbers of microbatches (even zero); FSDP2 runs an empty slot on the short rank.
    lengths = np.array([100, 100, 100])
    plan = [[[0], [1], [2]], []]
    odc = simulate(plan, lengths, MODEL, _hw(), "odc")
    assert odc.step_s == pytest.approx(_flop([100, 100, 100]).sum() / 1e9, rel=1e-9)
    assert odc.busy_s[1] == 0.0


def test_cli_scale_smoke(capsys):
    assert sim_main(["scale", "--models", "1.5b", "--worlds", "8", "--steps", "1", "--samples-per-rank", "2"]) == 0
    out = capsys.readouterr().out
    for arm in ("FSDP2 + random", "FSDP2 + batch_rebalance", "FSDP2 + plan lockstep", "ODC + plan free"):
        assert arm in out


def test_hsdp_one_node_equals_the_single_node_model_and_odc_pays_one_all_reduce_per_step():
    from benchmarks.sim.hsdp import simulate_hsdp

    hw = _hw(gpus_per_node=2, intra_bw=1e8, inter_bw=1e7, intra_lat=1e-5, inter_lat=1e-4)
    lengths = np.array([120, 40, 300, 80, 60, 200, 90, 10])
    # one replica: HSDP is plain sharding within the node (FSDP2 on equal microbatch counts, ODC on any)
    for system, plan in (("fsdp2", [[[0, 1], [2]], [[3], [4, 5]]]), ("odc", [[[0, 1], [2]], [[3], [4], [5]]])):
        expected = simulate(plan, lengths, MODEL, hw, system).step_s
        assert simulate_hsdp(plan, lengths, MODEL, hw, system).step_s == pytest.approx(expected)
    # two nodes x 2 GPUs, a rank with no microbatch: the slowest rank's in-node time plus one ring all-reduce of every
    # group's gradient shard (2 (R-1)/R x bytes / inter-node bandwidth + 2 hops), computed by hand here
    two_nodes = [[[0, 1], [2]], [[3]], [], [[4], [5], [6, 7]]]
    odc = simulate_hsdp(two_nodes, lengths, MODEL, hw, "odc")
    in_node = max(
        simulate([two_nodes[r], []], lengths, MODEL, hw, "odc").step_s - 2 * hw.barrier_lat for r in range(4)
    )
    shard_bytes = MODEL.num_params * MODEL.grad_bytes / 2
    assert odc.step_s == pytest.approx(in_node + 2 * hw.barrier_lat + shard_bytes / 1e7 + 2 * 1e-4)
    # FSDP2-HSDP pays an all-reduce per param group in every microbatch's backward (without overlap: exactly added)
    slots = [[[0], [1], [2]], [[3], [4], [5]], [[6], [7], [0]], [[1], [2], [3]]]
    serial = hw.with_(overlap=False)
    free_network = serial.with_(inter_bw=FAST, inter_lat=0.0)
    extra = (
        simulate_hsdp(slots, lengths, MODEL, serial, "fsdp2").step_s
        - simulate_hsdp(slots, lengths, MODEL, free_network, "fsdp2").step_s
    )
    _, _, params = MODEL.group_costs()
    per_slot = sum(p * MODEL.grad_bytes / 2 / 1e7 + 2 * 1e-4 for p in params)
    assert extra == pytest.approx(3 * per_slot)


def test_hsdp_memory_estimate_shards_the_training_state_over_the_node():
    from benchmarks.sim.hsdp import STATE_BYTES, hsdp_memory_gb

    parts = hsdp_memory_gb(MODEL, 8, 1024)
    assert parts["state"] == pytest.approx(STATE_BYTES * MODEL.num_params / 8 / 1e9)
    assert parts["total"] == pytest.approx(parts["state"] + parts["unsharded"] + parts["activations"])
    assert hsdp_memory_gb(MODEL, 4, 1024)["state"] == pytest.approx(2 * parts["state"])
