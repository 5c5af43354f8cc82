"""Tests of LengthBalancedBatchSampler: coverage, agreement between ranks, resume, datasets integration, errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odc_accelerate.planning import PLANS, LengthBalancedBatchSampler, claim_queue, dataset_lengths, plan_step

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def all_ranks(lengths, world, samples_per_step, **kwargs):
    return [LengthBalancedBatchSampler(lengths, world, r, samples_per_step, **kwargs) for r in range(world)]


def epoch_steps(samplers, epoch=0):
    for s in samplers:
        s.set_epoch(epoch)
    return [list(s) for s in samplers]  # [rank][step] -> list of microbatches


config = st.fixed_dictionaries(
    {
        "n": st.integers(1, 120),
        "world": st.integers(1, 6),
        "extra": st.integers(0, 30),
        "plan": st.sampled_from(PLANS),
        "drop_last": st.booleans(),
        "shuffle": st.booleans(),
        "seed": st.integers(0, 2**32),
        "data_seed": st.integers(0, 1000),
    }
)


def build(cfg, **overrides):
    lengths = np.random.default_rng(cfg["data_seed"]).integers(1, 12000, cfg["n"])
    samples_per_step = cfg["world"] + cfg["extra"]
    if cfg["drop_last"] and samples_per_step > cfg["n"]:
        samples_per_step = max(cfg["world"], cfg["n"])
    kwargs = dict(
        max_tokens_per_microbatch=8192,
        plan=cfg["plan"],
        drop_last=cfg["drop_last"],
        shuffle=cfg["shuffle"],
        seed=cfg["seed"],
    )
    kwargs.update(overrides)
    return lengths, samples_per_step, kwargs


@PROPS
@given(cfg=config)
def test_every_sample_once_per_epoch_and_ranks_agree(cfg):
    lengths, sps, kwargs = build(cfg)
    if cfg["drop_last"] and sps > lengths.size:
        return
    samplers = all_ranks(lengths, cfg["world"], sps, **kwargs)
    steps = epoch_steps(samplers, epoch=3)
    if cfg["plan"] == "dynamic":
        # Every rank yields the step's whole queue (claimed from while the step runs): the same on every rank, and
        # the global plan put back in claim order. Below, the dealt plan stands for what the ranks run.
        for r in range(cfg["world"]):
            assert steps[r] == steps[0]
        steps = [[samplers[0].global_plan(k, 3)[r] for k in range(len(samplers[0]))] for r in range(cfg["world"])]
        for k, queue in enumerate(epoch_steps(samplers[:1], epoch=3)[0]):
            assert queue == claim_queue(samplers[0].global_plan(k, 3))
    n_steps = len(samplers[0])
    expected_steps = lengths.size // sps if cfg["drop_last"] else -(-lengths.size // sps)
    assert n_steps == expected_steps
    assert all(len(rank_steps) == n_steps for rank_steps in steps), "same number of steps on every rank"
    used = [i for rank_steps in steps for step in rank_steps for mb in step for i in mb]
    assert len(used) == len(set(used)), "a sample used twice in an epoch"
    assert len(used) == (n_steps * sps if cfg["drop_last"] else lengths.size)
    for k in range(n_steps):
        step_plan = [steps[r][k] for r in range(cfg["world"])]
        # What the ranks yield, put together, is the global plan, and that is plan_step on the step's samples.
        assert step_plan == samplers[0].global_plan(k)
        idx = samplers[0].step_indices(k)
        local = plan_step(lengths[idx], cfg["world"], 8192, plan=cfg["plan"])
        assert step_plan == [[[int(idx[j]) for j in mb] for mb in rank] for rank in local]
        if cfg["plan"] == "lockstep":
            assert len({len(p) for p in step_plan}) == 1
        for rank in step_plan:
            for mb in rank:
                assert len(mb) <= 1 or lengths[mb].sum() <= 8192


@PROPS
@given(cfg=config, stop_at=st.integers(0, 20), new_world=st.integers(1, 6))
def test_resume_mid_epoch_is_exact(cfg, stop_at, new_world):
    lengths, sps, kwargs = build(cfg)
    if cfg["drop_last"] and sps > lengths.size:
        return
    world = cfg["world"]
    reference = epoch_steps(all_ranks(lengths, world, sps, **kwargs), epoch=1)
    n_steps = len(reference[0])
    stop_at = min(stop_at, n_steps)
    resumed = []
    for r in range(world):
        first = LengthBalancedBatchSampler(lengths, world, r, sps, **kwargs)
        first.set_epoch(1)
        it = iter(first)
        head = [next(it) for _ in range(stop_at)]
        state = first.state_dict()
        assert state["epoch"] == 1 and state["steps_consumed"] == stop_at
        # A fresh process: built with a different seed argument, then restored (the checkpoint's seed wins).
        other = dict(kwargs, seed=kwargs["seed"] + 1)
        second = LengthBalancedBatchSampler(lengths, world, r, sps, **other)
        second.load_state_dict(state)
        second.set_epoch(1)  # what a Trainer does at the start of the resumed epoch: keeps the resume point
        resumed.append(head + list(second))
        # The next epoch starts from its beginning again.
        second.set_epoch(2)
        assert len(list(second)) == n_steps
    assert resumed == reference

    # Resuming on a different number of ranks still uses each remaining sample of the epoch exactly once.
    if sps >= new_world:
        state = {"epoch": 1, "steps_consumed": stop_at, "seed": kwargs["seed"]}
        rest = []
        # dynamic: every rank yields the whole queue, so one rank's steps hold all of the remaining samples
        for r in range(1 if cfg["plan"] == "dynamic" else new_world):
            s = LengthBalancedBatchSampler(lengths, new_world, r, sps, **kwargs)
            s.load_state_dict(state)
            rest += [i for step in s for mb in step for i in mb]
        done = {i for rank_steps in reference for step in rank_steps[:stop_at] for mb in step for i in mb}
        everything = {i for rank_steps in reference for step in rank_steps for mb in step for i in mb}
        assert sorted(rest) == sorted(everything - done)


def test_epochs_differ_but_cover_the_same_samples_and_shuffle_false_follows_dataset_order():
    lengths = np.random.default_rng(0).integers(1, 9000, 200)
    s = LengthBalancedBatchSampler(lengths, 2, 0, 40, seed=5, drop_last=False)
    e0 = [s.step_indices(k, epoch=0).tolist() for k in range(len(s))]
    e1 = [s.step_indices(k, epoch=1).tolist() for k in range(len(s))]
    assert e0 != e1
    assert sorted(sum(e0, [])) == sorted(sum(e1, [])) == list(range(200))
    again = LengthBalancedBatchSampler(lengths, 2, 0, 40, seed=5, drop_last=False)
    assert [again.step_indices(k, epoch=1).tolist() for k in range(len(s))] == e1
    other_seed = LengthBalancedBatchSampler(lengths, 2, 0, 40, seed=6, drop_last=False)
    assert [other_seed.step_indices(k, epoch=1).tolist() for k in range(len(s))] != e1
    ordered = LengthBalancedBatchSampler(lengths, 2, 0, 40, shuffle=False)
    assert [ordered.step_indices(k).tolist() for k in range(len(ordered))] == [
        list(range(k * 40, (k + 1) * 40)) for k in range(5)
    ]


def test_short_last_step_policy():
    lengths = np.full(10, 100)
    # drop_last=False: 10 = 4 + 4 + 2 samples on 3 ranks; the last step has fewer samples than ranks.
    free = epoch_steps(all_ranks(lengths, 3, 4, drop_last=False))
    assert [len(rank) for rank in free] == [3, 3, 3]
    assert sorted(len(rank[-1]) for rank in free) == [0, 1, 1], "free: one rank has no microbatch in the last step"
    lock = epoch_steps(all_ranks(lengths, 3, 4, drop_last=False, plan="lockstep"))
    assert sorted(len(mb) for rank in lock for mb in rank[-1]) == [0, 1, 1]
    assert all(len(rank[-1]) == 1 for rank in lock), "lockstep: same number of (possibly empty) microbatches"
    # drop_last=True drops the 2 leftover samples.
    dropped = epoch_steps(all_ranks(lengths, 3, 4))
    assert [len(rank) for rank in dropped] == [2, 2, 2]
    assert len({i for rank in dropped for step in rank for mb in step for i in mb}) == 8


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (([], 2, 0, 4), {}, "empty"),
        (([5] * 10, 4, 0, 3), {}, "smaller than world_size"),
        (([5] * 10, 2, 0, 4), {"max_tokens_per_microbatch": 0}, "max_tokens_per_microbatch"),
        (([5] * 10, 2, 0, 4), {"max_tokens_per_microbatch": -1}, "max_tokens_per_microbatch"),
        (([5] * 10, 2, 2, 4), {}, "rank"),
        (([5] * 10, 2, 0, 12), {}, "larger than the dataset"),
        (([5] * 10, 2, 0, 4), {"seed": -1}, "seed"),
        (([5] * 10, 2, 0, 4), {"plan": "sync"}, "Unknown plan 'sync'"),
        (([5] * 10, 2, 0, 2.5), {}, "samples_per_step"),
        (([5, 9000], 2, 0, 2), {"allow_oversize": False}, "Sample 1 has 9000 tokens"),
    ],
)
def test_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LengthBalancedBatchSampler(*args, **kwargs)


def test_load_state_dict_rejects_a_different_run():
    s = LengthBalancedBatchSampler([5] * 40, 2, 0, 8)
    with pytest.raises(ValueError, match="samples_per_step=4"):
        s.load_state_dict({"epoch": 0, "steps_consumed": 1, "samples_per_step": 4})
    with pytest.raises(ValueError, match="num_samples=41"):
        s.load_state_dict({"epoch": 0, "steps_consumed": 1, "num_samples": 41})
    with pytest.raises(ValueError, match="steps_consumed"):
        s.load_state_dict({"epoch": 0, "steps_consumed": 6})


def test_costs_are_computed_once_per_distinct_length():
    calls = []

    def cost(n):
        calls.append(n)
        return float(n)

    s = LengthBalancedBatchSampler([7, 3, 7, 7, 3, 11] * 5, 2, 1, 6, cost=cost)
    list(s)
    s.set_epoch(1)
    list(s)
    assert sorted(calls) == [3, 7, 11]


# ------------------------------------------------------------------------------------------------------------------
# datasets integration
# ------------------------------------------------------------------------------------------------------------------


def test_from_dataset_lengths_and_cache():
    import datasets

    rng = np.random.default_rng(3)
    true_lengths = rng.integers(1, 300, 64)
    ds = datasets.Dataset.from_dict(
        {"input_ids": [list(range(n)) for n in true_lengths], "length": true_lengths.tolist()}
    )
    by_ids = LengthBalancedBatchSampler.from_dataset(ds, 2, 0, 8, length_column="input_ids")
    by_len = LengthBalancedBatchSampler.from_dataset(ds, 2, 0, 8)  # defaults to the "length" column
    np.testing.assert_array_equal(by_ids.lengths, true_lengths)
    np.testing.assert_array_equal(by_len.lengths, true_lengths)

    calls = []

    def length_fn(row):
        calls.append(1)
        return len(row["input_ids"])

    a = LengthBalancedBatchSampler.from_dataset(ds, 2, 1, 8, length_fn=length_fn)
    b = LengthBalancedBatchSampler.from_dataset(ds, 2, 0, 8, length_fn=length_fn)
    np.testing.assert_array_equal(a.lengths, true_lengths)
    assert len(calls) == 64, "lengths from a function are computed once per dataset and then cached"
    assert list(a) and list(b)

    # Row selection and shuffling change the fingerprint and the row mapping: lengths must follow.
    picked = ds.select([5, 1, 40])
    np.testing.assert_array_equal(dataset_lengths(picked, "input_ids"), true_lengths[[5, 1, 40]])
    shuffled = ds.shuffle(seed=0)
    np.testing.assert_array_equal(
        dataset_lengths(shuffled, "length"), np.array([len(r["input_ids"]) for r in shuffled])
    )
    split = ds.train_test_split(test_size=0.25, seed=0)["train"]
    np.testing.assert_array_equal(dataset_lengths(split, "input_ids"), np.array([len(r["input_ids"]) for r in split]))
    # Cached by fingerprint: the same dataset gives back the same (read-only) array without walking it again.
    assert dataset_lengths(ds, "input_ids") is dataset_lengths(ds, "input_ids")
    assert dataset_lengths(picked, "input_ids") is not dataset_lengths(ds, "input_ids")


def test_from_dataset_errors():
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["a", "bb", "ccc", "dddd"]})
    with pytest.raises(ValueError, match="length_column="):
        LengthBalancedBatchSampler.from_dataset(ds, 2, 0, 2)
    with pytest.raises(ValueError, match="'nope' is not in the dataset"):
        LengthBalancedBatchSampler.from_dataset(ds, 2, 0, 2, length_column="nope")
    with pytest.raises(ValueError, match="3 entries but the dataset has 4 rows"):
        LengthBalancedBatchSampler.from_dataset(ds, 2, 0, 2, lengths=[1, 2, 3])
    with pytest.raises(ValueError, match="empty"):
        LengthBalancedBatchSampler.from_dataset(ds.select([]), 2, 0, 2, lengths=[])
    with pytest.raises(ValueError, match="either"):
        dataset_lengths(ds, "text", len)
    s = LengthBalancedBatchSampler.from_dataset(ds, 2, 0, 2, length_fn=lambda row: len(row["text"]))
    np.testing.assert_array_equal(s.lengths, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="type string"):
        dataset_lengths(ds, "text")
    with pytest.raises(ValueError, match="map-style"):
        LengthBalancedBatchSampler.from_dataset(ds.to_iterable_dataset(), 2, 0, 2, length_column="text")


def test_from_plain_map_style_dataset():
    rows = [{"input_ids": list(range(n))} for n in (3, 9, 1, 4, 4, 7)]
    s = LengthBalancedBatchSampler.from_dataset(rows, 2, 0, 2, length_column="input_ids", plan="lockstep")
    np.testing.assert_array_equal(s.lengths, [3, 9, 1, 4, 4, 7])
    t = LengthBalancedBatchSampler.from_dataset(rows, 2, 0, 2, length_fn=lambda r: 2 * len(r["input_ids"]))
    np.testing.assert_array_equal(t.lengths, [6, 18, 2, 8, 8, 14])


def test_pair_lengths_count_tokens_and_costs_of_both_sequences():
    # DPO pairs: tokens = chosen + rejected, cost = cost(chosen) + cost(rejected) (not cost of the sum).
    rng = np.random.default_rng(3)
    pairs = rng.integers(5, 400, size=(40, 2))

    def cost(n: int) -> float:
        return n + n * n / 100.0

    sampler = LengthBalancedBatchSampler(
        pairs, world_size=2, rank=0, samples_per_step=8, max_tokens_per_microbatch=900, cost=cost
    )
    np.testing.assert_array_equal(sampler.lengths, pairs.sum(axis=1))
    expected = np.array([cost(int(a)) + cost(int(b)) for a, b in pairs])
    np.testing.assert_allclose(sampler.costs, expected)
    # every microbatch of every step respects the budget in pair tokens; every pair is used once per epoch
    seen = []
    for rank in range(2):
        r = LengthBalancedBatchSampler(
            pairs, world_size=2, rank=rank, samples_per_step=8, max_tokens_per_microbatch=900, cost=cost
        )
        for step in r:
            for mb in step:
                assert len(mb) == 1 or pairs[mb].sum() <= 900
                seen.extend(mb)
    assert sorted(seen) == list(range(40))
    with pytest.raises(ValueError, match="at least one column"):
        LengthBalancedBatchSampler(np.zeros((4, 0), dtype=int), world_size=2, rank=0, samples_per_step=2)
