"""ODC on a 2-D (replicate, shard) mesh: 4 real gloo processes as 2 emulated hosts x 2 ranks."""

import pytest

from odc_accelerate.testing import LaunchError, launch, read_pids, shm_files_of
from tests.helpers.workers.engine_workers import reference
from tests.helpers.workers.hsdp_workers import train_hsdp, train_hsdp_dynamic, train_hsdp_kill
from tests.multiprocess.test_engine_parity import rel_diff

# plan[step][rank] = sequence lengths, one sequence per microbatch; ranks 0-1 are host 0, ranks 2-3 host 1.
UNEQUAL = [
    [[12, 7, 9], [8], [], [10, 6]],  # rank 2 runs nothing: its replica partner's shard still needs every gradient
    [[5], [9, 11, 4], [13, 6], []],
    [[7, 7], [], [9], [6, 5, 12]],
]
BUCKET_BYTES = 60_000  # the toy model's param groups are 17-26 kB per shard: two groups per bucket, two buckets


def test_hsdp_parity_collectives_refusal_and_checkpoint_resume(tmp_path):
    spec = dict(mesh=(2, 2), plan=UNEQUAL, save_after=1, bucket_bytes=BUCKET_BYTES, checkpoint=str(tmp_path / "ckpt"))
    results = launch(train_hsdp, 4, spec, timeout=400)

    for res in results:
        # a shard group over two hosts is refused on every rank, with the fix
        assert "spans 2 hosts" in res["refusal"] and "dp_shard_size" in res["refusal"], res["refusal"]
        assert (res["transport"], res["replicas"], res["shard_world"]) == ("shm", 2, 2)

    # parity: equal to one process training on each step's whole batch (loss over the global token count)
    ref = reference(dict(plan=UNEQUAL))
    for rank, res in enumerate(results):
        assert rel_diff(res["params"], ref) <= 1e-6, (rank, rel_diff(res["params"], ref))
        assert rel_diff(res["params"], results[0]["params"]) == 0.0  # every replica holds the same model

    # collectives: none inside microbatches; exactly one all-reduce per bucket at pre_optimizer_step
    buckets = results[0]["buckets"]
    assert len(buckets) >= 2 and max(map(len, buckets)) > 1, buckets
    assert sorted(i for b in buckets for i in b) == list(range(4)), buckets
    for rank, res in enumerate(results):
        assert res["buckets"] == buckets
        for step, counts in enumerate(res["counts"]):
            assert counts["microbatches"] == {}, (rank, step, counts)
            api = {k: v for k, v in counts["pre_optimizer_step"].items() if k.startswith("api:")}
            assert api == {"api:all_reduce": len(buckets)}, (rank, step, counts)
        assert res["replicate_bytes"] > 0

    # checkpoint: the loaded model is the saved one, and resuming after step 1 (republished shards) trains on like the
    # uninterrupted run, up to the rounding of adds that peers make in a different order on each run
    for rank, res in enumerate(results):
        assert rel_diff(res["params_loaded"], res["params_saved"]) == 0.0, rank
        assert rel_diff(res["params_resumed"], res["params"]) <= 1e-7, (
            rank,
            rel_diff(res["params_resumed"], res["params"]),
        )
        assert rel_diff(res["params_resumed"], ref) <= 1e-6, rank


def test_hsdp_dynamic_plan_and_memory_policies_match_one_process(tmp_path):
    # One queue per step for all 4 ranks of both replicas; rank 3 is slow by construction (after each microbatch it
    # waits until a peer has drained the queue), so its peers take the rest. Under the default policy and with
    # parameters and gradients kept through the step (reduced once, before the replicas' all-reduce).
    spec = dict(mesh=(2, 2), plan=UNEQUAL, slow_rank=3, drain_dir=str(tmp_path), policies=["neither", "both"])
    results = launch(train_hsdp_dynamic, 4, spec, timeout=400)
    ref = reference(dict(plan=UNEQUAL))
    for policy in spec["policies"]:
        runs = [res[policy] for res in results]
        for step, rank_mbs in enumerate(UNEQUAL):
            claimed = sorted(i for run in runs for i in run["claimed"][step])
            assert claimed == list(range(sum(len(mbs) for mbs in rank_mbs))), (policy, step)
        # every microbatch was claimed by exactly one rank (above); the slow rank ran at most one per step
        assert all(len(c) <= 1 for c in runs[3]["claimed"]), (policy, [run["claimed"] for run in runs])
        for rank, run in enumerate(runs):
            assert all(kept == {g: policy for g in kept} for kept in run["kept"]), (policy, run["kept"])
            assert all(calls == {} for calls in run["calls"]), (policy, rank, run["calls"])  # no collective in claims
            assert rel_diff(run["params"], ref) <= 1e-6, (policy, rank, rel_diff(run["params"], ref))
            assert rel_diff(run["params"], runs[0]["params"]) == 0.0  # every replica holds the same model
    # the last step's scatter-adds: one per param group and microbatch, or (keeping gradients) one per param group
    for res in results:
        groups = len(res["both"]["kept"][-1])
        for policy, per_step in (("neither", len(res["neither"]["claimed"][-1])), ("both", 1)):
            ran = len(res[policy]["claimed"][-1])
            assert res[policy]["scatters"] == (groups * per_step if ran else 0), (policy, ran, res[policy]["scatters"])


def test_hsdp_killed_rank_is_named_on_every_host(pid_dir):
    # The engine's waits may last far longer than the job (1000 s against the launch's 300 s): an ODCTimeoutError
    # naming rank 3 on every survivor can then only come from noticing the dead rank, not from a wait running out.
    spec = dict(mesh=(2, 2), plan=UNEQUAL, kill_at=(3, 1), pid_dir=str(pid_dir), timeout=1000.0)
    with pytest.raises(LaunchError) as info:
        launch(train_hsdp_kill, 4, spec, timeout=300)
    failures = info.value.failures
    assert "without reporting" in failures[3]  # rank 3 really died
    for rank in (0, 1, 2):
        assert "ODCTimeoutError" in failures[rank] and "global rank(s) [3]" in failures[rank], (rank, failures[rank])
    assert shm_files_of(read_pids(pid_dir)) == []
