"""Bad input, timeouts, killed ranks, shared-memory hygiene and concurrent accumulation."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from odc_accelerate._compat import torch as torch_compat
from odc_accelerate.testing import LaunchError, launch, read_pids, shm_files_of
from odc_accelerate.transport.shm import cleanup_stale_segments
from tests.helpers.workers.engine_workers import train
from tests.helpers.workers.failure_workers import bad_inputs, context_exit_cleans_up, stress_accumulate

PLAN = [[[9, 7], [8, 6]], [[5, 9], [7, 8]], [[6, 6], [9, 5]]]

CASES = {
    # case: (exception type, words the message must contain)
    "plain_module": ("TypeError", ["fully_shard", "FSDP1", "DDP"]),
    "fsdp1": ("TypeError", ["FSDP2", "FullyShardedDataParallel"]),
    "ddp": ("TypeError", ["FSDP2", "DDP"]),
    "hsdp_shard_across_hosts": ("ValueError", ["spans 2 hosts", "dp_shard_size", "hierarchical"]),
    "several_param_groups": ("ValueError", ["one param group"]),
    "different_models": ("ValueError", ["same FSDP2 model", "rank(s) [1]"]),
    "offload_on_rank1_only": ("ValueError", ["CPUOffloadPolicy"]),
    "unknown_transport": ("ValueError", ["carrier-pigeon", "shm"]),
    "bad_timeout": ("ValueError", ["timeout"]),
    "nested_module": ("ValueError", ["ROOT"]),
    "grad_dtype_none": ("ValueError", ["blocks.1.up.weight", "grad_dtype=None", "reduce_dtype"]),
    "lifecycle": ("RuntimeError / RuntimeError", ["without pre_optimizer_step", "twice"]),
}


def test_bad_input_raises_clear_errors_on_every_rank():
    cases = dict(CASES)
    if not torch_compat.has("param_groups"):
        del cases["several_param_groups"]  # torch 2.11: one param group per fully_shard call, nothing to refuse
    if not torch_compat.has("grad_dtypes"):
        del cases["grad_dtype_none"]  # before torch 2.15 FSDP2 drops a param's grad_dtype: nothing to refuse
    results = launch(bad_inputs, 2, list(cases), timeout=240)
    for rank, outcomes in enumerate(results):
        for case, (kind, words) in cases.items():
            got_kind, message = outcomes[case]
            assert got_kind == kind, f"rank {rank} {case}: {got_kind}: {message}"
            for word in words:
                assert word in message, f"rank {rank} {case}: {word!r} not in {message!r}"


def test_optimizer_param_groups_that_differ_across_ranks_are_refused_on_every_rank():
    # Each case first trains a step with the same groups on every rank (accepted), then rank 1's optimizer groups the
    # parameters otherwise or orders one group differently: every rank refuses at the step's barrier, saying what to
    # change. A rank that passes no optimizer is not compared.
    cases = ["optimizer_grouping_differs", "optimizer_order_differs", "optimizer_on_rank0_only"]
    results = launch(bad_inputs, 2, cases, timeout=240)
    for rank, outcomes in enumerate(results):
        for case in cases[:2]:
            kind, message = outcomes[case]
            assert kind == "ValueError", f"rank {rank} {case}: {kind}: {message}"
            assert "optimizer's param groups to be the same on every rank" in message, message
            assert "Rank(s) [1] group or order them differently from rank(s) [0]" in message, message
            assert "(this rank: 2 group(s) of" in message and "model.named_parameters() order" in message, message
        assert outcomes["optimizer_on_rank0_only"] == ("no error", ""), outcomes


def test_hpz_reshard_after_forward_int_is_refused():
    results = launch(bad_inputs, 4, ["hpz"], timeout=240)
    for outcomes in results:
        kind, message = outcomes["hpz"]
        assert kind == "ValueError" and "reshard_after_forward" in message, message


def test_timeout_names_the_missing_rank(pid_dir):
    spec = dict(mode="odc", plan=PLAN, timeout=3.0, hang_rank=1, hang_seconds=12, pid_dir=str(pid_dir))
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(train, 2, spec, timeout=120)
    elapsed = time.monotonic() - start
    failure = info.value.failures[0]
    assert "ODCTimeoutError" in failure and "timed out after 3.0s" in failure and "rank(s) [1]" in failure, failure
    assert elapsed < 100  # nothing waited for the launcher's own timeout
    assert shm_files_of(read_pids(pid_dir)) == []


def test_killed_rank_is_detected_before_the_timeout_and_files_are_removed(pid_dir):
    spec = dict(mode="odc", plan=PLAN, timeout=300.0, kill_rank_at_step=(1, 1), pid_dir=str(pid_dir))
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(train, 2, spec, timeout=250)
    elapsed = time.monotonic() - start
    survivor = info.value.failures[0]
    assert "ODCTimeoutError" in survivor and "rank 1 (pid" in survivor and "exited" in survivor, survivor
    assert "without reporting" in info.value.failures[1]  # rank 1 really died
    assert elapsed < 200, "a dead rank must be noticed long before the 300 s timeout"
    pids = read_pids(pid_dir)
    assert len(pids) == 2 and shm_files_of(pids) == []


def test_files_are_private_and_none_outlives_set_up_or_exit(pid_dir):
    closed = launch(train, 2, dict(mode="odc", plan=PLAN[:1]), timeout=240)
    for res in closed:
        # the names are unlinked at the end of set-up: none is left while the engine runs (modes are checked on the
        # open files in test_concurrent_accumulation_loses_nothing)
        assert res["modes"] == [] and res["shm_files"] == []
        assert res["shm_files_after_close"] == []
    # no close() at all: nothing is left either (the names went at set-up)
    unclosed = launch(train, 2, dict(mode="odc", plan=PLAN[:1], skip_close=True, pid_dir=str(pid_dir)), timeout=240)
    assert unclosed[0]["job_id"]
    assert shm_files_of(read_pids(pid_dir)) == []


def test_exception_in_engine_context_removes_files_and_restores_fsdp2():
    for res in launch(context_exit_cleans_up, 2, timeout=240):
        assert res["during"] == [] and res["after"] == []  # unlinked at the end of set-up


def test_next_start_removes_segments_of_dead_processes(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"odc_0123abcd_r0_p{dead.pid}.seg"
    live = tmp_path / f"odc_0123abcd_r1_p{os.getpid()}.seg"
    unrelated = tmp_path / "odc_notes.txt"
    for path in (stale, live, unrelated):
        path.write_bytes(b"x")
    removed = cleanup_stale_segments(str(tmp_path))
    assert removed == [str(stale)]
    assert not stale.exists() and live.exists() and unrelated.exists()


def test_concurrent_accumulation_loses_nothing():
    world, adds, numel = 4, 3000, 4096
    results = launch(stress_accumulate, world, adds, numel, timeout=300)
    base = np.arange(numel, dtype=np.float64) % 13
    for owner, res in enumerate(results):
        expected = np.zeros(numel)
        for rank in range(world):
            count = sum(1 for i in range(adds) if (rank + i) % world == owner)
            expected += count * (base + rank + 1)
        np.testing.assert_array_equal(res["acc"], expected.astype(np.float32))
        assert res["peer_pub"] == [r + 1 for r in range(world)]
        # every rank's files are private, mapped or open here, and unlinked
        assert res["lock_modes"] == ["0o600"] * world
        assert all(mode in ("0o600", None) for mode in res["segment_modes"]), res["segment_modes"]
        assert len(res["segment_maps"]) == world and all(m.endswith(".seg (deleted)") for m in res["segment_maps"])
        assert not any(os.path.exists(p) for p in res["paths"])
