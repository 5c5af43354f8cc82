"""The ``dynamic`` plan's claim counters with real processes: each index of a round is claimed exactly once, whatever
the ranks' speeds (a much slower rank, a rank that claims none), on every transport's counter and the store fallback;
a rank killed after claiming ends the job with an error naming it."""

from __future__ import annotations

import pytest

from odc_accelerate.testing import launch
from tests.helpers.workers.claim_workers import BACKENDS, exactly_once, killed_after_claiming

COUNTS = {"race": 600, "slow": 24, "none": 6, "empty": 0, "again": 600}


def test_every_index_claimed_exactly_once(tmp_path):
    results = launch(exactly_once, 2, str(tmp_path), timeout=240)
    for backend in BACKENDS:
        for case, count in COUNTS.items():
            r0, r1 = results[0][backend][case], results[1][backend][case]
            # exactly once: disjoint, and together every index
            assert sorted(r0 + r1) == list(range(count)), (backend, case, r0, r1)
            # each rank's claims come in increasing order (one counter, fetch-and-add)
            assert r0 == sorted(r0) and r1 == sorted(r1), (backend, case)
        # the slow rank (waiting after its first claim until the counter is exhausted) took at most that one: the
        # fast rank ran the rest without waiting for it
        slow = results[1][backend]["slow"]
        assert len(slow) <= 1 and len(results[0][backend]["slow"]) >= 23, (backend, slow)
        assert results[1][backend]["none"] == [], backend  # a rank that claims none
        assert results[0][backend]["none"] == list(range(6)), backend
        # both ranks took part in the races (each waits after its first claim for its peer's first)
        assert results[0][backend]["race"] and results[1][backend]["race"], backend


@pytest.mark.parametrize("backend", ["shm", "network", "store"])
def test_killed_rank_after_claiming_is_named(tmp_path, backend):
    results = launch(killed_after_claiming, 2, backend, str(tmp_path), timeout=120, allow_failures=True)
    assert isinstance(results[1], str) and "without reporting" in results[1], results[1]  # SIGKILL: no report
    survivor = results[0]
    assert survivor["error"] is not None and "rank 1" in survivor["error"], survivor
    assert survivor["ranks"] == [1], survivor
    lost = [int(i) for i in (tmp_path / "rank1.claims").read_text().split(",")]
    # nothing run twice and nothing silently lost: rank 0 ran every index rank 1 did not claim, and the step failed
    assert sorted(survivor["claimed"] + lost) == list(range(20)), (survivor["claimed"], lost)


# 3 steps of 7 sequences each (lengths), as one queue per step under the dynamic plan
STEPS = [[[12, 30, 7, 22], [9, 16, 25]], [[28, 5, 14], [20, 11, 8, 19]], [[6, 26, 13, 17], [24, 10, 15]]]


def test_engine_dynamic_plan_matches_one_process_with_a_slower_rank(tmp_path):
    from tests.helpers.workers.engine_workers import reference, train

    # rank 1 is slow by construction: after each microbatch it waits until rank 0 has drained the step's queue
    spec = dict(plan=STEPS, clip=0.5, mode="odc", dynamic=True, slow_rank=1, drain_dir=str(tmp_path))
    results = launch(train, 2, spec, timeout=240)
    ref = reference(spec)
    for res in results:
        num = sum(float(((res["params"][k].astype("float64") - ref[k]) ** 2).sum()) for k in ref)
        den = sum(float((ref[k].astype("float64") ** 2).sum()) for k in ref)
        assert (num / den) ** 0.5 <= 1e-5  # the same model as one process training on every step's whole batch
        assert all(c == {} for c in res["counts"]), "claims and microbatches make no torch.distributed call"
    for step, (r0, r1) in enumerate(zip(results[0]["claimed"], results[1]["claimed"], strict=True)):
        assert sorted(r0 + r1) == list(range(7)), (step, r0, r1)
    # the slow rank ran at most one microbatch per step, its peer the rest: the queue went to the rank that was free
    assert all(len(r1) <= 1 for r1 in results[1]["claimed"]), results[1]["claimed"]
    errors = results[0]["claim_errors"]
    assert len(errors) == 2 and "already called in this optimizer step" in errors[0]
    assert "call it before pre_optimizer_step()" in errors[1]
