"""The 'cuda' transport's set-up cannot hang: a rank that fails or stalls in symmetric memory's allocation or
rendezvous (calls with no timeout) ends its blocked peers with a message naming it. Real 2-process gloo jobs on CPU,
the transport's protocol over shared memory with one rank made to fail or hang there."""

from __future__ import annotations

import pytest

from odc_accelerate.testing import launch, read_pids, shm_files_of
from tests.helpers.cuda_setup import stuck_setup_worker

pytestmark = pytest.mark.multiprocess


def test_a_rank_failing_to_allocate_ends_its_peer_blocked_in_the_rendezvous(tmp_path):
    # The timeout is far beyond the job's limit: only the failed rank's phase can end rank 0 in time.
    spec = {"dir": str(tmp_path), "mode": "fail", "timeout": 600.0}
    results = launch(stuck_setup_worker, 2, spec, timeout=120, allow_failures=True)
    assert "emulated: CUDA out of memory" in results[1]  # rank 1 raised its own error
    assert "exited with code 1" in results[0]
    message = (tmp_path / "rank0.stderr").read_text()
    assert "ODC 'cuda' transport on rank 0: rank 1 failed during the 'cuda' transport's set-up" in message
    assert "rank 0 in the symmetric-memory rendezvous" in message and "rank 1 failed" in message
    assert shm_files_of(read_pids(tmp_path)) == []


def test_a_stalled_set_up_ends_every_rank_after_the_timeout_naming_the_rank_behind(tmp_path):
    spec = {"dir": str(tmp_path), "mode": "hang", "timeout": 2.0}
    results = launch(stuck_setup_worker, 2, spec, timeout=120, allow_failures=True)
    assert all("exited with code 1" in r for r in results)
    messages = [(tmp_path / f"rank{rank}.stderr").read_text() for rank in range(2)]
    timed_out = [
        rank
        for rank, message in enumerate(messages)
        if f"ODC 'cuda' transport on rank {rank}: the set-up did not finish within 2s" in message
    ]
    # Whichever rank's watchdog fires first names rank 1 as furthest behind; the other either does the same or, if
    # its peer already exited, names that peer as exited.
    assert timed_out, messages
    for rank, message in enumerate(messages):
        assert "rank 1 allocating its segment" in message
        if rank in timed_out:
            assert "furthest behind: rank(s) [1]" in message
        else:
            assert f"rank {1 - rank} exited during the 'cuda' transport's set-up" in message
    assert shm_files_of(read_pids(tmp_path)) == []
