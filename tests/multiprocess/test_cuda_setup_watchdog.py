"""The 'cuda' transport's set-up cannot hang: a rank that fails or stalls in symmetric memory's allocation or
rendezvous (calls with no timeout) ends its blocked peers with a message naming it, and a rank out of GPU memory is a
refusal on every rank. Real 2-process gloo jobs on CPU, the transport's protocol over shared memory with one rank made
to fail, hang or run out of memory there."""

from __future__ import annotations

import pytest

from odc_accelerate.testing import launch, read_pids, shm_files_of
from tests.helpers.workers.cuda_setup import (
    engine_publish_oom_worker,
    extension_layout_worker,
    lazy_init_oom_worker,
    stuck_setup_worker,
)

pytestmark = pytest.mark.multiprocess


MiB = 2**20


def test_a_rank_failing_in_the_rendezvous_ends_its_peer_blocked_there(tmp_path):
    # The timeout is far beyond the job's limit: only the failed rank's phase can end rank 0 in time.
    spec = {"dir": str(tmp_path), "mode": "fail", "timeout": 600.0}
    results = launch(stuck_setup_worker, 2, spec, timeout=120, allow_failures=True)
    assert "emulated: the rendezvous' socket failed" in results[1]  # rank 1 raised its own error
    assert "exited with code 1" in results[0]
    message = (tmp_path / "rank0.stderr").read_text()
    assert "ODC 'cuda' transport on rank 0: rank 1 failed during the 'cuda' transport's set-up" in message
    assert "rank 0 in the symmetric-memory rendezvous" in message and "rank 1 failed" in message
    assert shm_files_of(read_pids(tmp_path)) == []


@pytest.mark.parametrize("oom_error", ["allocator", "driver"])
def test_a_rank_out_of_memory_allocating_is_a_refusal_on_every_rank_naming_need_and_free(tmp_path, oom_error):
    # Rank 1's allocation runs out of memory after the memory check passed (2 GiB stated free); rank 0 allocated and
    # must not enter the rendezvous: both raise the same refusal, nobody exits, nothing waits for the timeout.
    spec = {"dir": str(tmp_path), "mode": "oom", "oom_error": oom_error, "timeout": 600.0, "free_bytes": 2048 * MiB}
    results = launch(stuck_setup_worker, 2, spec, timeout=120, allow_failures=True)
    for rank, text in enumerate(results):
        assert "exited with code" not in text, (rank, text)
        assert "RuntimeError: the 'cuda' ODC transport cannot run: rank 1 need(s)" in text, (rank, text)
        assert "but only 2048.0 MiB is free" in text and "its allocation ran out of GPU memory" in text
    assert shm_files_of(read_pids(tmp_path)) == []


def test_too_little_stated_free_memory_is_refused_on_every_rank_before_any_allocation(tmp_path):
    # 1 MiB stated free: the memory check refuses from the gathered facts, before the control plane or any segment.
    spec = {"dir": str(tmp_path), "mode": "oom", "timeout": 600.0, "free_bytes": MiB}
    results = launch(stuck_setup_worker, 2, spec, timeout=120, allow_failures=True)
    for text in results:
        assert "the 'cuda' ODC transport cannot run: rank 0 need(s)" in text and "but only 1.0 MiB is free" in text
        assert "set-up margin" in text and "emulated" not in text  # rank 1's allocation was never reached
    assert shm_files_of(read_pids(tmp_path)) == []


def test_a_stalled_allocation_ends_every_rank_after_the_timeout_naming_the_rank_behind(tmp_path):
    # Rank 1's watchdog waits longer than rank 0, so that rank 0's wait on the host always ends first (with equal
    # timeouts, a rank 1 that started allocating well before rank 0 started waiting was ended by its watchdog first).
    spec = {"dir": str(tmp_path), "mode": "hang", "timeout": 2.0, "rank_timeouts": {1: 8.0}}
    results = launch(stuck_setup_worker, 2, spec, timeout=120, allow_failures=True)
    # Rank 0 allocated and waits for rank 1 on the host: it raises, naming rank 1.
    assert "timed out after 2s waiting for rank(s) [1] to allocate their segments" in results[0]
    # Rank 1 is blocked in the allocation (a call with no timeout): its watchdog ends the process.
    assert "exited with code 1" in results[1]
    message = (tmp_path / "rank1.stderr").read_text()
    assert "ODC 'cuda' transport on rank 1" in message and "rank 1 allocating its segment" in message
    assert shm_files_of(read_pids(tmp_path)) == []


def test_out_of_memory_in_the_engines_set_up_is_a_refusal_and_its_peer_stops_at_once(tmp_path):
    # Rank 1 runs out of memory publishing its first shards, after the transport was set up. The timeouts are far
    # beyond the job's limit: rank 0, waiting for rank 1 in the publish barrier, must stop because rank 1 closed.
    spec = {"dir": str(tmp_path), "timeout": 600.0}
    results = launch(engine_publish_oom_worker, 2, spec, timeout=120)
    assert results[1].startswith("RuntimeError: rank 1 need(s) more GPU memory for ODC's set-up (its transport holds")
    assert "MiB per rank" in results[1] and "it ran out of GPU memory" in results[1], results[1]
    assert "shard over more GPUs" in results[1], results[1]
    assert "ODC barrier on rank 0: rank 1 (pid" in results[0], results[0]
    assert "closed its transport before reaching barrier #" in results[0], results[0]
    assert shm_files_of(read_pids(tmp_path)) == []


@pytest.mark.parametrize("oom_error", ["allocator", "driver"])
def test_out_of_memory_in_fsdp2_lazy_init_is_a_refusal_saying_so(tmp_path, oom_error):
    # FSDP2's lazy init runs first in the engine, before the transport's memory check: an out-of-memory error there
    # (a driver error when it creates its CUDA streams) must still be a refusal that says what ran out and what to do.
    results = launch(lazy_init_oom_worker, 2, {"dir": str(tmp_path), "oom_error": oom_error}, timeout=120)
    for rank, text in enumerate(results):
        assert text.startswith(
            f"RuntimeError: rank {rank} need(s) more GPU memory for FSDP2's lazy initialisation (its CUDA streams and "
            "buffers, made when the ODC engine starts"
        ), text
        assert "before ODC allocates anything" in text and "(it ran out of GPU memory)" in text, text
        assert "more GPUs to shard over" in text, text
    assert shm_files_of(read_pids(tmp_path)) == []


def test_one_rank_out_of_memory_in_fsdp2_lazy_init_stops_its_peer_with_the_same_refusal(tmp_path):
    # Only rank 1's lazy init runs out (its GPU fuller than its peer's). Rank 0 goes on to the ranks' agreement on the
    # model, where it must raise rank 1's refusal instead of waiting for rank 1 until the process group's timeout
    # (gloo's default, 30 min: far beyond the job's limit).
    spec = {"dir": str(tmp_path), "oom_error": "driver", "ranks": [1]}
    results = launch(lazy_init_oom_worker, 2, spec, timeout=120, allow_failures=True)
    assert results[1].startswith("RuntimeError: rank 1 need(s) more GPU memory for FSDP2's lazy initialisation"), (
        results
    )
    assert results[0] == results[1], results
    assert shm_files_of(read_pids(tmp_path)) == []


def test_parameters_with_an_all_gather_extension_are_sized_one_at_a_time_before_the_memory_check(tmp_path):
    # Only the extension knows its inputs' sizes, so they are built before the transport's memory check: one
    # parameter's at a time, and the layout equals FSDP2's metadata's (the emulated extension makes FSDP2's inputs).
    results = launch(extension_layout_worker, 2, {"dir": str(tmp_path)}, timeout=120)
    for result in results:
        assert result == {"error": "", "layouts_match": True, "most_params_per_call": 1}, result
    assert shm_files_of(read_pids(tmp_path)) == []


def test_one_rank_out_of_memory_sizing_an_all_gather_extension_stops_every_rank_with_its_refusal(tmp_path):
    # Rank 1 runs out building an extension's inputs, before the memory check; rank 0 must stop with the same refusal
    # at the ranks' agreement, not wait for rank 1 in the transport's set-up.
    spec = {"dir": str(tmp_path), "oom_rank": 1, "oom_error": "allocator"}
    results = launch(extension_layout_worker, 2, spec, timeout=120, allow_failures=True)
    texts = [r["error"] if isinstance(r, dict) else r for r in results]
    assert texts[1].startswith(
        "RuntimeError: rank 1 need(s) more GPU memory for the all-gather inputs of its parameters with an all-gather "
        "extension (FSDP2's fsdp_pre_all_gather, e.g. float8: built one parameter at a time"
    ), texts
    assert texts[0] == texts[1], texts
    assert shm_files_of(read_pids(tmp_path)) == []
