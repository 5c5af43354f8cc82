"""The ordered reduction's transport side (`odc_accelerate.transport.ordered`) on every transport, real gloo processes:
each owner's sum equals an independent reference summed in rank order, bit for bit, where other summation orders give
other bits; a rank without microbatches contributes zeros; the 'cuda' transport's protocol adds nothing atomically."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from odc_accelerate.testing import launch
from tests.helpers.workers.ordered_workers import GROUPS, microbatch_rows, ordered_steps

TRANSPORTS = ("shm", "network", "hierarchical", "cuda-on-cpu")
# counts[step][rank]: microbatches per rank and step; every world has a rank with none in some step
COUNTS = {
    2: [[3, 2], [2, 0]],
    3: [[2, 1, 3], [1, 0, 2]],
    4: [[2, 0, 3, 1], [0, 1, 2, 3]],
}


@functools.cache
def run(world_size: int) -> list[dict]:
    """Every transport's sums, by rank: one job per world size (the kernel runs under Triton's interpreter)."""
    spec = {"transports": TRANSPORTS, "counts": COUNTS[world_size]}
    return launch(ordered_steps, world_size, spec, timeout=300, env={"TRITON_INTERPRET": "1"})


def contributions(step: int, world_size: int, group: str, owner: int) -> list[torch.Tensor]:
    """Each rank's contribution to ``owner``'s shard: its microbatches' rows summed in its own order, from zero, in
    the contributions' dtype (a rank without microbatches contributes zeros)."""
    numel, dtype = GROUPS[group]
    out = []
    for rank in range(world_size):
        c = torch.zeros(numel, dtype=dtype)
        for index in range(COUNTS[world_size][step][rank]):
            c += microbatch_rows(step, rank, index, world_size, group)[owner]
        out.append(c)
    return out


def fp32_sum(terms: list[torch.Tensor]) -> np.ndarray:
    """``t_0 + t_1 + ...`` left to right in fp32, in numpy (each add rounded to fp32)."""
    acc = terms[0].float().numpy().copy()
    for t in terms[1:]:
        acc = (acc + t.float().numpy()).astype(np.float32)
    return acc


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_each_owner_sums_the_ranks_in_rank_order_bit_for_bit(world_size, transport):
    results = run(world_size)
    for owner, result in enumerate(results):
        got = result[transport]
        assert got["transport"] == transport
        for step in range(len(COUNTS[world_size])):
            for group in GROUPS:
                expected = fp32_sum(contributions(step, world_size, group, owner))
                sums = got["sums"][step][group]
                assert sums.dtype == np.float32 and sums.tobytes() == expected.tobytes(), (owner, step, group)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_other_summation_orders_give_other_bits(world_size):
    # The values make the order visible: summed as the atomic reduction may land them (microbatch slot by slot over
    # the ranks, or in reverse), the first step's fp32 sums differ from the rank-ordered ones in some elements.
    step, group, owner = 0, "c0", 0
    counts = COUNTS[world_size][step]
    rows = {
        (r, k): microbatch_rows(step, r, k, world_size, group)[owner]
        for r in range(world_size)
        for k in range(counts[r])
    }
    ordered = fp32_sum(contributions(step, world_size, group, owner))
    by_slot = [rows[(r, k)] for k in range(max(counts)) for r in range(world_size) if k < counts[r]]
    assert fp32_sum(by_slot).tobytes() != ordered.tobytes()
    assert fp32_sum(by_slot[::-1]).tobytes() != ordered.tobytes()
    if world_size > 2:  # two terms commute exactly; from three nonzero ones on, the ranks' order itself shows
        reverse = fp32_sum(contributions(step, world_size, group, owner)[::-1])
        assert reverse.tobytes() != ordered.tobytes()
    assert (np.asarray(counts) == 0).any() or (np.asarray(COUNTS[world_size][1]) == 0).any()  # a rank contributes 0


def test_the_cuda_transports_protocol_performs_no_atomic_add():
    for world_size in (2, 3, 4):
        for rank, result in enumerate(run(world_size)):
            cuda = result["cuda-on-cpu"]
            assert cuda["accumulate_path"] == "kernel", cuda["accumulate_path"]  # the kernel was ready to add
            assert set(cuda["atomic_calls"].values()) == {0}, (world_size, rank, cuda["atomic_calls"])
            # the counters work: one deliberate accumulate goes through the transport and the kernel
            after = cuda["atomic_calls_after_one_accumulate"]
            assert after["CudaTransport.accumulate"] == 1 and after["accumulate_ (kernel)"] == 1, after
