"""Tests of planning for padded collation (odc_accelerate.planning.padded) and the sampler's ``padded=True``."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odc_accelerate.planning import (
    PLANS,
    LengthBalancedBatchSampler,
    claim_queue,
    padded_microbatch,
    plan_from_costs,
    plan_padded,
    resolve_cost,
)

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def row_cost(widths):
    widths = np.asarray(widths, dtype=np.float64)
    return widths / 100.0 + (widths / 100.0) ** 2


def padded_cost(mb, rows, widths):
    """What a padded collator makes a microbatch cost: every row as wide as the widest sample (computed directly)."""
    if not mb:
        return 0.0
    return float(sum(rows[i] for i in mb) * row_cost(max(widths[i] for i in mb)))


def check_padded_plan(plan, rows, widths, world, budget, plan_name):
    n = rows.size
    assert len(plan) == world
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(n)), "every index exactly once"
    for rank in plan:
        for mb in rank:
            r, w = padded_microbatch(mb, rows, widths)
            assert len(mb) <= 1 or r * w <= budget, "microbatch over budget in padded tokens"
    if plan_name == "free":
        assert all(mb for rank in plan for mb in rank), "free plans have no empty microbatch"
        if n >= world:
            assert all(plan), "a rank idles although there are enough samples"
    elif plan_name == "dynamic":
        queue = claim_queue(plan)  # raises unless dealt round-robin
        costs = [padded_cost(mb, rows, widths) for mb in queue]
        assert all(queue) and costs == sorted(costs, reverse=True), "the queue runs costliest first"
    else:
        assert len({len(rank) for rank in plan}) == 1, "lockstep: every rank runs the same number of microbatches"


@PROPS
@given(
    shapes=st.lists(st.tuples(st.integers(1, 2), st.integers(0, 3000)), max_size=60),
    world=st.integers(1, 8),
    budget=st.sampled_from([1, 1024, 4096, 8192]),
    plan_name=st.sampled_from(PLANS),
)
def test_padded_plan_invariants(shapes, world, budget, plan_name):
    rows = np.array([r for r, _ in shapes], dtype=np.int64)
    widths = np.array([w for _, w in shapes], dtype=np.int64)
    plan = plan_padded(rows, widths, row_cost(widths), world, budget, plan_name)
    check_padded_plan(plan, rows, widths, world, budget, plan_name)
    assert plan == plan_padded(rows, widths, row_cost(widths), world, budget, plan_name), "deterministic"


def _min_count_cut_total(members, rows, widths, budget):
    """Independent reference: padded cost of the widest-first consecutive cut of one rank's samples."""
    total, run = 0.0, []
    for i in sorted(members, key=lambda i: (-widths[i], i)):
        if run and (sum(rows[j] for j in run) + rows[i]) * widths[run[0]] <= budget:
            run.append(i)
        else:
            total += padded_cost(run, rows, widths)
            run = [i]
    return total + padded_cost(run, rows, widths)


def test_free_padded_against_brute_force_and_the_token_planner(capsys):
    """Max padded rank total vs the best assignment of samples to ranks (each rank cut widest-first), and vs the
    token-counting planner (which packs unlike lengths together) evaluated on what the padded collator computes."""
    rng = np.random.default_rng(7)
    gaps, token_ratio = [], []
    budget = 1024
    for _ in range(150):
        world = 2
        n = int(rng.integers(2, 9))
        rows = np.full(n, 2)
        widths = np.minimum(rng.lognormal(4.8, 0.8, n).astype(np.int64) + 8, 512)  # 2 x 512 fits the budget
        plan = plan_padded(rows, widths, row_cost(widths), world, budget, "free")
        got = max(sum(padded_cost(mb, rows, widths) for mb in rank) for rank in plan)
        best = min(
            max(_min_count_cut_total([i for i in range(n) if a[i] == r], rows, widths, budget) for r in range(world))
            for a in itertools.product(range(world), repeat=n)
        )
        assert got <= best * 1.25 + 1e-9
        gaps.append(got / best - 1)
        costs = rows * row_cost(widths)  # what the token planner balances: no padding between samples
        by_tokens = plan_from_costs(costs, rows * widths, world, budget, "free")
        token_ratio.append(max(sum(padded_cost(mb, rows, widths) for mb in rank) for rank in by_tokens) / got)
    with capsys.disabled():
        print(
            f"\n[padded free vs optimum, 150 instances n<=8, W=2] mean gap {100 * np.mean(gaps):.2f}% "
            f"(max {100 * max(gaps):.1f}%); token planner's padded max total / ours: mean {np.mean(token_ratio):.3f}"
        )
    assert np.mean(gaps) <= 0.03
    assert np.mean(token_ratio) >= 1.05  # counting padding pays on long-tailed pairs


def test_lockstep_padded_fills_slots_with_similar_widths():
    rows = np.full(8, 2)
    widths = np.array([500, 40, 480, 50, 60, 470, 45, 490])
    plan = plan_padded(rows, widths, row_cost(widths), 2, 1024, "lockstep")
    check_padded_plan(plan, rows, widths, 2, 1024, "lockstep")
    # the four wide pairs each fill a microbatch, the four narrow ones share one per rank: 3 slots
    assert [len(rank) for rank in plan] == [3, 3]
    for k in range(3):
        slot = [padded_microbatch(plan[r][k], rows, widths)[1] for r in range(2)]
        assert max(slot) - min(slot) <= 20, slot  # like widths run together


def test_padded_plan_errors():
    with pytest.raises(ValueError, match="same length"):
        plan_padded(np.ones(3), np.ones(2), np.ones(3), 2, 100)
    with pytest.raises(ValueError, match="at least one row"):
        plan_padded(np.zeros(2), np.ones(2), np.ones(2), 2, 100)
    with pytest.raises(ValueError, match="Unknown plan 'bogus'"):
        plan_padded(np.ones(2), np.ones(2), np.ones(2), 2, 100, "bogus")
    assert plan_padded(np.ones(0), np.ones(0), np.ones(0), 3, 100) == [[], [], []]


def test_sampler_padded_pairs_match_the_trl_collator_and_stay_within_budget():
    """The padded shapes the sampler plans are those TRL's preference collator builds, within the budget."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    rng = np.random.default_rng(5)
    n, budget = 48, 1024
    prompt = rng.integers(2, 60, n)
    chosen = rng.lognormal(4.5, 0.9, n).astype(int) + 1
    rejected = rng.lognormal(4.5, 0.9, n).astype(int) + 1
    pairs = np.minimum(np.stack([prompt + chosen, prompt + rejected], axis=1), 512)
    examples = [
        {"prompt_ids": [1] * int(p), "chosen_ids": [2] * int(c), "rejected_ids": [3] * int(r)}
        for p, c, r in zip(prompt, chosen, rejected, strict=True)
    ]
    collator = DataCollatorForPreference(pad_token_id=0, max_length=512)
    samplers = [
        LengthBalancedBatchSampler(
            pairs, world_size=2, rank=r, samples_per_step=8, max_tokens_per_microbatch=budget, padded=True
        )
        for r in range(2)
    ]
    widths = pairs.max(axis=1)
    # a pair costs two rows as wide as its longer sequence
    np.testing.assert_allclose(samplers[0].costs, 2 * resolve_cost("auto")(widths))
    seen = []
    for k, steps in enumerate(zip(*samplers, strict=True)):
        assert [list(s) for s in steps] == samplers[0].global_plan(k)
        for step in steps:
            for mb in step:
                batch = collator([examples[i] for i in mb])
                assert tuple(batch["input_ids"].shape) == padded_microbatch(mb, np.full(n, 2), widths)
                assert len(mb) == 1 or batch["input_ids"].numel() <= budget
                seen.extend(mb)
    assert sorted(seen) == list(range(n))
    with pytest.raises(ValueError, match="more than max_tokens_per_microbatch"):
        # padded tokens of a pair (2 x its longer sequence) count against the budget
        LengthBalancedBatchSampler(
            np.array([[300, 100]]), 1, 0, 1, max_tokens_per_microbatch=500, padded=True, allow_oversize=False
        )
