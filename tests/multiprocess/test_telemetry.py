"""CollectiveTimer counts time blocked in collectives: FSDP2's comms and the torch.distributed API, each call once."""

from odc_accelerate.testing import launch


def _dist_api_worker(rank: int, world_size: int) -> dict:
    import time

    import torch
    import torch.distributed as dist

    from odc_accelerate.telemetry import CollectiveTimer, timed_dist_functions

    original = dist.all_reduce
    dist.barrier()  # both ranks start together (untimed)
    before = timed_dist_functions()
    timer = CollectiveTimer(fsdp_comms=False)
    patched = dist.all_reduce is not original
    listed = timed_dist_functions()
    if rank == 1:
        time.sleep(0.5)  # rank 0 reaches the all-reduce first and has to wait for rank 1
    t = torch.ones(4)
    dist.all_reduce(t)
    waited = timer.take()
    calls = timer.calls
    # A collective made from inside another timed call is counted once (FSDP2's comms call the dist API).
    timer._timed(lambda: dist.barrier())
    nested_calls = timer.calls - calls
    timer.close()
    return {
        "listed": (before, "all_reduce" in listed and "barrier" in listed, timed_dist_functions()),
        "fsdp": _fsdp_check(rank),
        "patched": patched,
        "restored": dist.all_reduce is original,
        "waited": waited,
        "sum": float(t.sum()),
        "nested_calls": nested_calls,
        "after_take": timer.take() >= 0.0,
    }


def _fsdp_check(rank: int) -> dict:
    import torch
    import torch.distributed as dist

    from odc_accelerate.telemetry import CollectiveTimer
    from odc_accelerate.testing.models import ToyConfig, build_model, shard_model, token_loss_sum

    model = shard_model(build_model(ToyConfig(vocab=64, dim=32, heads=2, layers=2), seed=0))
    original = dist.all_reduce
    timer = CollectiveTimer(model)
    ids = torch.randint(0, 64, (1, 17), generator=torch.Generator().manual_seed(rank))
    loss, _ = token_loss_sum(model, ids)
    loss.backward()
    calls, seconds = timer.calls, timer.take()
    timer.close()
    return {"calls": calls, "seconds": seconds, "restored": dist.all_reduce is original}


def test_collective_timer_counts_dist_api_and_fsdp2_comms_once_and_restores_them():
    r0, r1 = launch(_dist_api_worker, 2, timeout=180)
    for r in (r0, r1):
        assert r["patched"] and r["restored"] and r["after_take"]
        assert r["listed"] == ([], True, [])  # timed_dist_functions: none before, the wrapped ones, none after close
        assert r["sum"] == 8.0  # the wrapped all-reduce still reduces
        assert r["nested_calls"] == 1
        fsdp = r["fsdp"]
        # forward all-gathers (2 blocks + root), backward all-gathers and reduce-scatters: all through the timer
        assert fsdp["calls"] >= 6, fsdp
        assert fsdp["seconds"] > 0.0 and fsdp["restored"]
    # rank 0 cannot leave the all-reduce before rank 1, which slept 0.5 s, enters it (a bound, not a timing figure)
    assert r0["waited"] >= 0.25
