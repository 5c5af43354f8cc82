"""The engine under the ordered reduction (``ODCEngine(reduction="ordered")``), with real gloo processes on CPU.

Unequal microbatch counts (a rank with none in some steps), against one process and bit for bit against itself: with
a rank slowed at random microbatches, on every transport, under every memory policy. The owners' sums take fixed
operands in a fixed order, so none of that may change a bit of the weights.
"""

import numpy as np

from odc_accelerate.testing import launch
from tests.helpers.workers.engine_workers import reference
from tests.helpers.workers.ordered_engine_workers import ordered_engine_runs, ordered_hsdp_runs
from tests.multiprocess.test_engine_parity import rel_diff

# plan[step][rank] = sequence lengths, one sequence per microbatch
UNEQUAL = [[[12], [10, 9, 8]], [[], [12, 8]], [[7, 11, 5], []], [[9], [9, 6, 14]]]
POLICIES = ("neither", "params", "grads", "both", "auto")


def _configs():
    configs = [dict(name=f"shm/{p}", transport="shm", memory_policy=p) for p in POLICIES]
    configs += [
        dict(name="shm/neither/slowed", transport="shm", slow_seed=11),
        dict(name="shm/both/slowed", transport="shm", memory_policy="both", slow_seed=12),
        dict(name="network", transport="network", slow_seed=13),
        dict(name="cuda-on-cpu", transport="cuda-on-cpu", slow_seed=14),
        # the streams of a GPU, faked on CPU: which events the engine records and waits for around its local adds
        dict(name="shm/neither/streams", transport="shm", fake_streams=True),
        # positive control for the counted atomic paths, after the ordered run: the atomic reduction goes through them
        dict(name="atomic", transport="cuda-on-cpu", reduction="atomic"),
    ]
    return configs


def check_stream_order(log: list[tuple]) -> None:
    """The engine's own events order its local adds (on the reduce-scatter stream) before every read of a
    contribution, and after the previous step's zeroing (on the default stream): ``FakeStreams``' log."""
    latest_add, synchronized, zeroed, waited = None, set(), None, True
    adds = waits = 0
    for what, *rest in log:
        if what == "record" and rest[0] == "reduce-scatter":
            assert waited, f"an add before its stream waited for the zeroing (event {zeroed}): {log}"
            latest_add, adds = rest[1], adds + 1
        elif what == "synchronize":
            synchronized.add(rest[1])
        elif what == "read":
            assert latest_add is None or latest_add in synchronized, f"{rest[0]} read before this rank's adds: {log}"
        elif what == "record" and rest[0] == "default":
            zeroed, waited = rest[1], False
        elif what == "wait" and rest[0] == "reduce-scatter" and rest[1] == zeroed:
            waited, waits = True, waits + 1
    assert adds > 0 and waits > 0 and synchronized, log


def test_ordered_matches_one_process_and_repeats_bit_for_bit_on_every_transport_and_policy():
    configs = _configs()
    results = launch(ordered_engine_runs, 2, dict(plan=UNEQUAL, configs=configs, slow_rank=1), timeout=400)
    ref = reference(dict(plan=UNEQUAL, clip=0.5))
    first = results[0]["shm/neither"]["params"]
    assert rel_diff(first, ref) <= 1e-5, rel_diff(first, ref)
    for res in results:
        for config in configs:
            run = res[config["name"]]
            if config.get("reduction") == "atomic":
                assert run["reduction"] == "atomic" and not any(b.startswith("c0/") for b in run["buffers"])
                assert rel_diff(run["params"], ref) <= 1e-5  # the atomic reduction: the same to rounding
                continue
            assert run["reduction"] == "ordered" and run["reduction_reason"] == "set by odc_reduction"
            # bitwise: whatever the transport, the memory policy or which rank finished first
            for name, value in first.items():
                np.testing.assert_array_equal(run["params"][name], value, err_msg=f"{config['name']} {name}")
            # one contribution buffer per param group and owner; no gradient kept by the memory policy
            assert {"c0/to0", "c0/to1", "scratch/float32"} <= set(run["buffers"]), run["buffers"]
            assert run["stats"]["kept_grads"] == 0
            kept = {choice for step in run["kept"] for choice in step.values()}
            assert kept <= {"params", "neither"}, (config["name"], kept)
            policy = config.get("memory_policy", "neither")
            expected = {"neither": "neither", "grads": "neither", "params": "params", "both": "params"}.get(policy)
            if expected:
                assert kept == {expected}, (config["name"], kept)
            # the exchange: this rank read its peer's contribution to every shard of the last step (both ran there)
            assert run["stats"]["bytes_read"] > 0 and run["stats"]["exchange_s"] > 0
        # the emulated 'cuda' transport never adds atomically under ordered
        assert res["cuda-on-cpu"]["transport"] == "cuda-on-cpu"
        assert set(res["cuda-on-cpu"]["atomic_calls"].values()) == {0}, res["cuda-on-cpu"]["atomic_calls"]
        assert res["atomic"]["atomic_calls"]["CudaTransport.accumulate"] > 0, res["atomic"]["atomic_calls"]
        check_stream_order(res["shm/neither/streams"]["stream_log"])


# ranks 0-1 are host 0, ranks 2-3 host 1
HSDP_UNEQUAL = [
    [[12, 7, 9], [8], [], [10, 6]],
    [[5], [9, 11, 4], [13, 6], []],
    [[7, 7], [], [9], [6, 5, 12]],
]


def test_ordered_under_hsdp_matches_one_process_and_repeats_bit_for_bit():
    spec = dict(mesh=(2, 2), plan=HSDP_UNEQUAL, slow_rank=2, slow_seed=5)
    results = launch(ordered_hsdp_runs, 4, spec, timeout=400)
    ref = reference(dict(plan=HSDP_UNEQUAL, clip=0.5))
    first = results[0]["plain"]["params"]
    assert rel_diff(first, ref) <= 1e-5, rel_diff(first, ref)
    for rank, res in enumerate(results):
        for name in ("plain", "slowed"):
            assert res[name]["reduction"] == "ordered" and res[name]["replicas"] == 2
            for key, value in first.items():
                np.testing.assert_array_equal(res[name]["params"][key], value, err_msg=f"rank {rank} {name} {key}")
