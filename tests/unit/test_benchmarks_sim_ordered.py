"""The simulator's ordered-reduction arm (``python -m benchmarks.sim ordered``) against a hand calculation."""

import numpy as np
import pytest

from benchmarks.sim import ordered
from benchmarks.sim.simulator import Hardware, ModelSpec, simulate

GB = 1e9


def test_the_ordered_arm_matches_a_hand_calculation():
    # Two ranks on one node, nothing overlapped, no latency but a 1 ms barrier; rank 0 runs three microbatches, rank 1
    # one. Each microbatch reads the peer's half of the bf16 parameters in forward and in backward, P/2 x 2 bytes at
    # 100 GB/s each, and adds nothing into the owners. After the slowest rank, each owner reads the peer's half of its
    # bf16 gradient once, P/2 x 2 bytes at 100 GB/s, whatever the microbatch counts; three barriers.
    model = ModelSpec(layers=2, hidden=1024, intermediate=4096, heads=8, param_bytes=2, grad_bytes=2)
    hw = Hardware(
        flops=1e12,
        gpus_per_node=2,
        intra_bw=10 * GB,
        inter_bw=10 * GB,
        p2p_intra_bw=100 * GB,
        p2p_acc_intra_bw=5 * GB,
        barrier_lat=1e-3,
        overlap=False,
    )
    plan, lengths = [[[0], [1], [2]], [[3]]], np.array([1000, 500, 700, 3000])
    got = simulate(plan, lengths, model, hw, "odc", reduction="ordered")
    p = model.num_params
    read = p / (100 * GB)  # (W-1)/W x P x 2 bytes
    slowest = max(got.busy_s[0] + 3 * 2 * read, got.busy_s[1] + 1 * 2 * read)
    assert got.exchange_s == pytest.approx(read)
    assert got.step_s == pytest.approx(slowest + read + 3e-3)
    # the atomic arm pays its adds in the backward instead (at 5 GB/s, here in every microbatch) and two barriers
    atomic = simulate(plan, lengths, model, hw, "odc")
    assert atomic.exchange_s == 0.0
    assert atomic.step_s == pytest.approx(
        max(got.busy_s[0] + 3 * (2 * read + p / (5 * GB)), got.busy_s[1] + 2 * read + p / (5 * GB)) + 2e-3
    )
    # gradients kept for the step do not matter to the ordered arm
    kept = simulate(plan, lengths, model, hw, "odc", reduction="ordered", accumulate_locally=True)
    assert kept.step_s == got.step_s


def test_the_ordered_arm_is_odcs_only():
    model = ModelSpec(layers=1, hidden=64, intermediate=128, heads=4)
    hw = Hardware(flops=1e12, gpus_per_node=2, intra_bw=GB, inter_bw=GB)
    with pytest.raises(ValueError, match="FSDP2 reduce-scatters"):
        simulate([[[0]], [[1]]], np.array([8, 8]), model, hw, "fsdp2", reduction="ordered")
    with pytest.raises(ValueError, match="Unknown reduction 'sorted'"):
        simulate([[[0]], [[1]]], np.array([8, 8]), model, hw, "odc", reduction="sorted")


def test_the_table_names_the_faster_reduction_per_case():
    case = {
        "model": "1.5b",
        "workload": "sft",
        "overlap": True,
        "fsdp2_step_s": 8.0,
        "atomic_step_s": {
            f"{rate}, {mode}": value
            for rate, values in {"index_add_": (6.6, 6.5), "kernel": (6.2, 6.3)}.items()
            for mode, value in zip(("every microbatch", "kept for the step"), values, strict=True)
        },
        "ordered_step_s": 6.4,
        "ordered_exchange_s": 0.002,
    }
    assert ordered.winner(case, "index_add_") == "ordered, 1.56%"  # against the better atomic mode, 6.5
    assert ordered.winner(case, "kernel") == "atomic, 3.23%"
    row = ordered.format_table({"cases": [case]}).splitlines()[2]
    assert row.startswith("| 1.5b | SFT | on | 8.000 | 6.600 | 6.500 | 6.200 | 6.300 | 6.400 | 2.0 |")
