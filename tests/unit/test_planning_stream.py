"""Tests of StreamingStepPlanner and StreamStepDataset: plans against the map-style sampler, agreement between ranks,
resume, drop_last and passes, real `datasets.IterableDataset` streams, errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odc_accelerate.planning import (
    PLANS,
    LengthBalancedBatchSampler,
    StepRows,
    StreamingStepPlanner,
    dataset_lengths,
)

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def lookup(lengths):
    """Length function of a stream of sample ids: the ids index ``lengths``."""
    return lambda chunk: np.asarray(lengths)[np.asarray(chunk)]


def in_samples(step):
    """The step's global plan in samples instead of positions."""
    return [[[step.samples[j] for j in mb] for mb in rank] for rank in step.plan]


config = st.fixed_dictionaries(
    {
        "n": st.integers(5, 90),
        "world": st.integers(1, 5),
        "extra": st.integers(0, 20),
        "plan": st.sampled_from(PLANS),
        "padded": st.booleans(),
        "pairs": st.booleans(),
        "budget": st.sampled_from([512, 4096, 16384]),
        "data_seed": st.integers(0, 1000),
    }
)


@PROPS
@given(cfg=config)
def test_each_step_is_planned_as_the_sampler_plans_the_same_samples_in_the_same_order(cfg):
    rng = np.random.default_rng(cfg["data_seed"])
    shape = (cfg["n"], 2) if cfg["pairs"] else (cfg["n"],)
    lengths = rng.integers(1, 6000, shape)
    sps = min(cfg["world"] + cfg["extra"], cfg["n"])  # at least one step
    kwargs = dict(max_tokens_per_microbatch=cfg["budget"], plan=cfg["plan"], padded=cfg["padded"])
    planner = StreamingStepPlanner(cfg["world"], sps, **kwargs)
    steps = list(planner.steps(range(cfg["n"]), lookup(lengths), passes=1))
    assert len(steps) == cfg["n"] // sps  # drop_last
    # Independent reference: the map-style sampler on the whole dataset read in order (no shuffle).
    sampler = LengthBalancedBatchSampler(lengths, cfg["world"], 0, sps, shuffle=False, drop_last=True, **kwargs)
    assert len(sampler) == len(steps)
    for k, step in enumerate(steps):
        assert step.index == k and step.pass_index == 0
        assert step.samples == list(range(k * sps, (k + 1) * sps))
        assert in_samples(step) == sampler.global_plan(k)
        # and the map-style planner run on each step's chunk alone (a sampler over just those samples)
        chunk = LengthBalancedBatchSampler(lengths[step.samples], cfg["world"], 0, sps, shuffle=False, **kwargs)
        assert step.plan == chunk.global_plan(0)


@pytest.mark.parametrize("plan", PLANS)
def test_every_rank_keeps_its_own_part_and_the_parts_cover_the_step(plan):
    lengths = np.random.default_rng(3).integers(1, 3000, 61)
    world, sps = 3, 10
    planners = [StreamingStepPlanner(world, sps, 4096, plan=plan) for _ in range(world)]
    per_rank = [list(p.steps(list(range(61)), lookup(lengths), passes=1)) for p in planners]
    for steps in zip(*per_rank, strict=True):
        assert all(s.plan == steps[0].plan for s in steps)  # ranks agree without talking
        kept = [sample for rank, s in enumerate(steps) for mb in s.microbatches(rank) for sample in mb]
        assert sorted(kept) == steps[0].samples
        if plan == "dynamic":
            queued = [sample for mb in steps[0].queue() for sample in mb]
            assert sorted(queued) == steps[0].samples and all(s.queue() == steps[0].queue() for s in steps)
        counts = [len(s.microbatches(rank)) for rank, s in enumerate(steps)]
        if plan == "lockstep":
            assert len(set(counts)) == 1


def test_resume_skips_steps_without_computing_their_lengths_and_continues_exactly():
    lengths = np.random.default_rng(0).integers(1, 5000, 23)
    planner = StreamingStepPlanner(2, 5, 8192)
    full = list(planner.steps(range(23), lookup(lengths), passes=3))
    assert [s.index for s in full] == list(range(12)) and [s.pass_index for s in full] == [0] * 4 + [1] * 4 + [2] * 4
    for start in (1, 4, 6, 11):
        asked = []

        def counted(chunk, asked=asked):
            asked.append(list(chunk))
            return lookup(lengths)(chunk)

        resumed = list(planner.steps(range(23), counted, start_step=start, passes=3))
        assert [(s.index, s.pass_index, s.samples, s.plan) for s in resumed] == [
            (s.index, s.pass_index, s.samples, s.plan) for s in full[start:]
        ]
        assert asked == [s.samples for s in full[start:]]  # skipped steps are read, not measured or planned
    assert list(planner.steps(range(23), lookup(lengths), start_step=12, passes=3)) == []


def test_final_incomplete_step_is_dropped_and_a_new_pass_starts():
    planner = StreamingStepPlanner(2, 5, 8192, cost="tokens")
    steps = planner.steps(range(23), lambda chunk: [10] * len(chunk))
    first = [next(steps) for _ in range(6)]
    # samples 20-22 never form a step; the second pass starts again from the stream's start
    assert [s.samples[0] for s in first] == [0, 5, 10, 15, 0, 5]
    assert [s.pass_index for s in first] == [0, 0, 0, 0, 1, 1]


def test_passes_call_set_epoch_and_follow_a_shuffled_datasets_stream():
    from datasets import Dataset

    rows = [{"input_ids": list(range(1 + (7 * i) % 40)), "id": i} for i in range(30)]
    stream = Dataset.from_list(rows).to_iterable_dataset(num_shards=3).shuffle(seed=5, buffer_size=8)
    planner = StreamingStepPlanner(2, 4, 64, cost="tokens")
    steps = list(planner.steps(stream, passes=2))
    assert len(steps) == 2 * (30 // 4)
    expected = []
    for epoch in (0, 1):
        stream.set_epoch(epoch)
        order = [row["id"] for row in stream]
        assert sorted(order) == list(range(30))
        expected += [order[k * 4 : (k + 1) * 4] for k in range(30 // 4)]
    assert [[row["id"] for row in s.samples] for s in steps] == expected
    assert expected[0:7] != expected[7:14]  # set_epoch drew a new order for the second pass
    # the default length function reads "input_ids", as dataset_lengths does on a map-style dataset
    for s in steps:
        want = dataset_lengths(Dataset.from_list(s.samples))
        assert in_samples(s) == [[[s.samples[j] for j in mb] for mb in rank] for rank in planner.plan(want)]


def test_step_rows_look_like_a_map_style_dataset():
    rows = StepRows([{"input_ids": [1, 2, 3], "length": 9, "text": "a"}, {"input_ids": [4], "length": 2, "text": "b"}])
    assert len(rows) == 2 and rows[1]["text"] == "b" and rows["length"] == [9, 2]
    assert rows.column_names == ["input_ids", "length", "text"]
    assert dataset_lengths(rows).tolist() == [9, 2]  # the "length" column wins, as for a datasets.Dataset
    trimmed = rows.remove_columns(["length", "text"])
    assert trimmed.column_names == ["input_ids"] and dataset_lengths(trimmed).tolist() == [3, 1]
    assert rows.column_names == ["input_ids", "length", "text"]  # the original is unchanged


def test_step_dataset_yields_each_ranks_microbatches_and_resumes():
    import torch
    from datasets import Dataset

    from odc_accelerate.integrations.trainer.data import StepCollator, StreamStepDataset

    rows = [{"input_ids": list(range(2 + (11 * i) % 50)), "text": str(i)} for i in range(27)]
    stream = Dataset.from_list(rows).to_iterable_dataset()
    planner = StreamingStepPlanner(2, 6, 128, cost="tokens", padded=True)
    steps = list(planner.steps(stream, passes=2))

    def loader(rank, start=0):
        data = StreamStepDataset(stream, planner, rank, lengths_fn=lambda c: [len(r["input_ids"]) for r in c])
        data.start_step = start
        collate = StepCollator(lambda feats: [int(f["input_ids"][-1]) + 1 for f in feats])  # a row's length
        items = torch.utils.data.DataLoader(data, batch_size=None, collate_fn=collate)
        return data, items

    for rank in (0, 1):
        data, items = loader(rank)
        got = [item for _, item in zip(range(len(steps)), items, strict=False)]
        assert data.steps_consumed == len(steps)
        assert got == [[[len(r["input_ids"]) for r in mb] for mb in s.microbatches(rank)] for s in steps]
        data, items = loader(rank, start=5)
        assert next(iter(items)) == got[5] and data.steps_consumed == 6


def test_step_dataset_keeps_only_the_given_columns():
    from odc_accelerate.integrations.trainer.data import StreamStepDataset

    rows = [{"input_ids": [1] * (i + 1), "text": "x"} for i in range(4)]
    data = StreamStepDataset(rows, StreamingStepPlanner(1, 2, 64), 0, lambda c: [1, 1], columns=["input_ids"])
    first = next(iter(data))
    assert all(set(row) == {"input_ids"} for mb in first for row in mb)


def test_step_dataset_refuses_dataloader_workers():
    import torch

    from odc_accelerate.integrations.trainer.data import StreamStepDataset

    data = StreamStepDataset([{"input_ids": [1]}] * 4, StreamingStepPlanner(1, 2, 64), 0, lambda c: [1, 1])
    with pytest.raises(RuntimeError, match="set --dataloader_num_workers 0"):
        next(iter(torch.utils.data.DataLoader(data, batch_size=None, num_workers=1)))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: StreamingStepPlanner(4, 3), "samples_per_step=3 is smaller than world_size=4"),
        (lambda: StreamingStepPlanner(2, 4, plan="bogus"), "Unknown plan 'bogus'"),
        (lambda: StreamingStepPlanner(2, 4, 0), "`max_tokens_per_microbatch`"),
        (lambda: next(StreamingStepPlanner(2, 4).steps([], lambda c: [1] * len(c))), "Pass 0 .* is empty"),
        (
            lambda: next(StreamingStepPlanner(2, 5).steps(range(3), lambda c: [1] * len(c))),
            r"has only 3 sample\(s\), fewer than samples_per_step=5",
        ),
        (
            lambda: next(StreamingStepPlanner(2, 4).steps(range(8), lambda c: [1, 2])),
            "Training stream, optimizer step 1: The length function gave 2 length",
        ),
        (
            lambda: next(StreamingStepPlanner(2, 2, 10, allow_oversize=False).steps(range(4), lambda c: [5, 11])),
            "Training stream, optimizer step 1: Sample 1 has 11 tokens",
        ),
        (
            lambda: next(StreamingStepPlanner(2, 2).steps([{"text": "a"}] * 2)),
            "Training stream, optimizer step 1: Cannot tell the length of a sample",
        ),
        (lambda: next(StreamingStepPlanner(2, 2).steps([[1, 2]] * 2)), "not a dict of columns"),
        (lambda: next(StreamingStepPlanner(2, 2).steps(range(4), start_step=-1)), "`start_step`"),
    ],
    ids=[
        "fewer-samples-than-ranks",
        "unknown-plan",
        "no-budget",
        "empty-stream",
        "short-stream",
        "wrong-length-count",
        "oversize",
        "no-length-column",
        "not-dict-rows",
        "negative-start",
    ],
)
def test_errors_say_what_to_change(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_a_later_pass_without_a_complete_step_raises_instead_of_looping():
    class Shrinking:
        """A stream whose second pass is shorter than one step."""

        def __init__(self):
            self.epoch = 0

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __iter__(self):
            return iter(range(4 if self.epoch == 0 else 1))

    steps = StreamingStepPlanner(2, 2, cost="tokens").steps(Shrinking(), lambda c: [1] * len(c))
    assert [s.samples for s in (next(steps), next(steps))] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="Pass 1 over the training stream has only 1 sample"):
        next(steps)


def test_a_one_shot_iterator_says_it_cannot_be_read_again():
    steps = StreamingStepPlanner(2, 2, cost="tokens").steps(iter(range(5)), lambda c: [1] * len(c))
    assert len([next(steps), next(steps)]) == 2
    with pytest.raises(ValueError, match="Pass 1 .* is empty.*can be read again"):
        next(steps)
