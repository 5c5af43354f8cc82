"""Host-side logic of the CUDA transport, on CPU: sizing, refusals from device facts, chunked adds.

The GPU path itself (symmetric memory, atomics over NVLink) is checked by ``scripts/gpu_check.sh`` on a GPU machine.
"""

import logging
import os

import pytest
import torch
import torch.distributed as dist

from odc_accelerate.reduction import ReductionName
from odc_accelerate.transport import BufferSpec, CudaTransport, create_transport
from odc_accelerate.transport.cuda import cuda_unavailable_reason, local_device_facts
from odc_accelerate.transport.cuda.segments import (
    ALIGN,
    DEFAULT_STAGING_MIB,
    MAX_DEFAULT_STAGING_MIB,
    OVERLAP_ENV,
    SEGMENT_GRANULARITY,
    SETUP_MARGIN_BYTES,
    STAGING_ENV,
    DeviceFacts,
    StagingPool,
    accumulator_dtype,
    atomics_problem,
    choose_reduction,
    chunk_spans,
    device_refusal,
    memory_refusal,
    plan_segment,
    staging_bytes_setting,
)

MiB = 2**20
SPECS = {
    "p0": BufferSpec(numel=10, dtype=torch.bfloat16),
    "g0": BufferSpec(numel=7, dtype=torch.bfloat16, accumulated=True),
    "touched": BufferSpec(numel=3, dtype=torch.uint8),
    "g1": BufferSpec(numel=3000, dtype=torch.bfloat16, accumulated=True),
}


# ----------------------------------------------------------------------------------------------- settings and sizing
def test_staging_setting_defaults_env_and_refusals(monkeypatch):
    monkeypatch.delenv(STAGING_ENV, raising=False)
    assert staging_bytes_setting() == DEFAULT_STAGING_MIB * MiB <= MAX_DEFAULT_STAGING_MIB * MiB
    assert staging_bytes_setting(8) == 8 * MiB
    monkeypatch.setenv(STAGING_ENV, "16")
    assert staging_bytes_setting() == 16 * MiB
    assert staging_bytes_setting(4) == 4 * MiB  # the argument wins over the environment
    monkeypatch.setenv(STAGING_ENV, "lots")
    with pytest.raises(ValueError, match=f"\\${STAGING_ENV} must be a number"):
        staging_bytes_setting()
    with pytest.raises(ValueError, match="staging_mib must be > 0"):
        staging_bytes_setting(0)


def test_accumulators_are_fp32_unless_asked_for_less():
    assert accumulator_dtype(torch.bfloat16) == torch.float32
    assert accumulator_dtype(torch.float16) == torch.float32
    assert accumulator_dtype(torch.float32) == torch.float32
    assert accumulator_dtype(torch.bfloat16, torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="floating-point"):
        accumulator_dtype(torch.bfloat16, torch.int32)
    plan = plan_segment(SPECS, 1 * MiB)
    assert plan.dtypes["g0"] == plan.dtypes["g1"] == torch.float32 and plan.needs_cast
    assert plan.dtypes["p0"] == torch.bfloat16  # published shards keep their dtype
    narrow = plan_segment(SPECS, 1 * MiB, accumulate_dtype=torch.bfloat16)
    assert narrow.dtypes["g1"] == torch.bfloat16 and not narrow.needs_cast


def test_layout_is_aligned_disjoint_and_views_have_the_stored_dtype():
    plan = plan_segment(SPECS, 1 * MiB)
    spans = sorted((plan.offsets[n], plan.offsets[n] + plan.numels[n] * plan.dtypes[n].itemsize) for n in SPECS)
    assert all(start % ALIGN == 0 for start, _ in spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] <= plan.segment_bytes
    segment = torch.zeros(plan.segment_bytes, dtype=torch.uint8)
    views = {n: plan.view(segment, n) for n in SPECS}
    assert views["g1"].dtype == torch.float32 and views["g1"].numel() == 3000
    views["g1"].fill_(1.0)
    assert not views["g0"].any() and not views["p0"].any()  # writing one buffer leaves the others alone


@pytest.mark.parametrize("world_size", [2, 8, 64])
def test_memory_is_shard_plus_accumulator_plus_bounded_pool_whatever_the_world_size(world_size):
    # A 7B-parameter model in bf16 with an fp32 accumulator: per rank P/W params and P/W gradient elements.
    params = 7_000_000_000
    shard = -(-params // world_size)
    specs = {
        "p0": BufferSpec(numel=shard, dtype=torch.bfloat16),
        "g0": BufferSpec(numel=shard, dtype=torch.bfloat16, accumulated=True),
    }
    staging = DEFAULT_STAGING_MIB * MiB
    plan = plan_segment(specs, staging)
    report = plan.report()
    assert report["published"] == shard * 2
    assert report["accumulator"] == shard * 4
    assert report["staging"] <= staging
    assert report["total"] <= report["published"] + report["accumulator"] + report["staging"] + 2 * SEGMENT_GRANULARITY
    # The former design kept world_size - 1 staging slots per accumulator: about a whole unsharded gradient.
    assert report["total"] < shard * 6 + staging + 2 * SEGMENT_GRANULARITY < (world_size - 1) * shard * 2 + shard * 6
    assert "published" in plan.describe() and "staging" in plan.describe()


def test_pool_is_no_larger_than_the_largest_accumulator_needs_and_refuses_a_useless_size():
    plan = plan_segment(SPECS, 64 * MiB)
    assert plan.chunk_numel == 3000  # the largest accumulator fits in one chunk
    assert plan.staging_bytes == 3000 * (4 + 4)  # int32 index + fp32 cast per element
    fp32 = {"g": BufferSpec(numel=10_000, dtype=torch.float32, accumulated=True)}
    assert plan_segment(fp32, 64 * MiB).staging_bytes == 10_000 * 4  # no cast chunk when nothing is narrower
    frozen = {"p0": BufferSpec(numel=10, dtype=torch.bfloat16)}
    assert plan_segment(frozen, 64 * MiB).staging_bytes == 0  # a gather-only engine needs no pool
    with pytest.raises(ValueError, match="cannot hold a chunk"):
        plan_segment(SPECS, 1000)


def test_chunk_spans_cover_exactly():
    for numel, chunk in [(0, 4), (1, 4), (8, 4), (9, 4), (10_001, 1024)]:
        spans = list(chunk_spans(numel, chunk))
        assert [i for a, b in spans for i in range(a, b)] == list(range(numel))
        assert all(0 < b - a <= chunk for a, b in spans)
    with pytest.raises(ValueError):
        list(chunk_spans(5, 0))


# ------------------------------------------------------------------------------------------------- the add itself
def test_chunked_adds_from_several_senders_sum_bf16_gradients_in_fp32():
    # Three ranks' segments in one process (on GPUs: this rank's own and the peers' mapped segments); every rank adds
    # its bf16 slice into every owner's accumulator through a small pool, in several chunks per add.
    world, steps = 3, 4
    plan = plan_segment(SPECS, 8 * 1024)  # 1024-element chunks: g1 (3000 elements) takes 3 chunks
    assert plan.chunk_numel == 1024
    segments = [torch.zeros(plan.segment_bytes, dtype=torch.uint8) for _ in range(world)]
    views = [{n: plan.view(seg, n) for n in SPECS} for seg in segments]
    pools = [StagingPool(plan.chunk_numel, plan.cast_dtype, torch.device("cpu")) for _ in range(world)]
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(steps, world, world, 3000, generator=gen).to(torch.bfloat16)  # [step, sender, owner, elem]
    narrow = [torch.zeros(3000, dtype=torch.bfloat16) for _ in range(world)]  # what a bf16 accumulator would hold
    for step in range(steps):
        for sender in range(world):
            for owner in range(world):
                chunks = pools[sender].add(views[owner]["g1"], grads[step, sender, owner])
                assert chunks == 3
                narrow[owner] += grads[step, sender, owner]
    for owner in range(world):
        exact = grads[:, :, owner].double().sum(dim=(0, 1))
        acc = views[owner]["g1"]
        assert acc.dtype == torch.float32
        fp32_err = (acc.double() - exact).abs().max().item()
        bf16_err = (narrow[owner].double() - exact).abs().max().item()
        assert fp32_err < 1e-5
        assert bf16_err > 100 * fp32_err  # what widening buys over summing a step in bf16
        assert not views[owner]["g0"].any()  # nothing spilled into the neighbouring buffer
    with pytest.raises(ValueError, match="accumulate of 5 elements"):
        pools[0].add(views[1]["g1"], torch.zeros(5))
    with pytest.raises(TypeError, match="float32 accumulators"):
        pools[0].add(views[1]["p0"], torch.zeros(10, dtype=torch.bfloat16))


def test_pool_without_cast_chunk_refuses_narrower_gradients():
    pool = StagingPool(1024, torch.float32, torch.device("cpu"), cast=False)
    dst = torch.zeros(10)
    pool.add(dst, torch.ones(10))
    assert torch.equal(dst, torch.ones(10))
    with pytest.raises(TypeError, match="no cast chunk"):
        pool.add(dst, torch.ones(10, dtype=torch.bfloat16))


def test_adds_refuse_deterministic_mode():
    pool = StagingPool(1024, torch.float32, torch.device("cpu"))
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError, match="use_deterministic_algorithms"):
            pool.add(torch.zeros(4), torch.ones(4))
    finally:
        torch.use_deterministic_algorithms(before)


# -------------------------------------------------------------------------------------- refusals from device facts
def _gpu(rank: int, uuids: tuple[str, ...], own: int, **kw) -> DeviceFacts:
    base = dict(
        host="node",
        uuid=uuids[own],
        visible=uuids,
        access=tuple(True for _ in uuids),
        atomics=tuple(True for _ in uuids),
        free_bytes=80 * 2**30,
    )
    base.update(kw)
    return DeviceFacts(**base)


NODE = ("GPU-a", "GPU-b", "GPU-c", "GPU-d")


def test_an_nvlink_node_passes():
    assert device_refusal([_gpu(r, NODE, r) for r in range(4)]) is None


def test_shared_gpu_needs_the_override_on_every_rank():
    one = ("GPU-a",)
    facts = [_gpu(0, one, 0, allow_overlap=True), _gpu(1, one, 0)]
    reason = device_refusal(facts)
    assert reason and OVERLAP_ENV in reason and "[1]" in reason
    assert device_refusal([_gpu(r, one, 0, allow_overlap=True) for r in range(2)]) is None


def test_every_shared_gpu_is_checked_for_the_override():
    # Ranks 0-1 share GPU-a with the switch set; ranks 2-3 share GPU-b and rank 3 lacks it.
    pair = ("GPU-a", "GPU-b")
    facts = [_gpu(r, pair, r // 2, allow_overlap=r != 3) for r in range(4)]
    reason = device_refusal(facts)
    assert reason and "ranks [2, 3] share one GPU" in reason and "rank(s) [3]" in reason
    assert device_refusal([_gpu(r, pair, r // 2, allow_overlap=True) for r in range(4)]) is None


def test_one_visible_gpu_per_rank_is_refused_before_rendezvous():
    # CUDA_VISIBLE_DEVICES per rank: every rank is device 0 and sees only its own GPU.
    facts = [_gpu(r, (NODE[r],), 0) for r in range(2)]
    reason = device_refusal(facts)
    assert reason and "cannot see rank 1's GPU" in reason and "CUDA_VISIBLE_DEVICES" in reason


def test_no_peer_access_or_no_native_atomics_is_refused():
    pcie_no_p2p = [_gpu(r, NODE[:2], r, access=(r == 0, r == 1)) for r in range(2)]
    assert "peer-to-peer" in device_refusal(pcie_no_p2p)
    pcie_p2p = [_gpu(r, NODE[:2], r, atomics=(r == 0, r == 1)) for r in range(2)]
    assert "no native atomic adds" in device_refusal(pcie_p2p)
    unknown = [_gpu(r, NODE[:2], r, atomics=(True, None) if r == 0 else (True, True)) for r in range(2)]
    assert "could not query" in device_refusal(unknown)


def test_a_refusal_for_missing_peer_atomics_names_the_ordered_reduction():
    ordered = (
        "To run on these GPUs, set odc_reduction: ordered (ODC_REDUCTION=ordered, --odc_reduction ordered): each owner "
        "then reads the ranks' gradients and sums them itself in rank order, with no atomic adds. Or use plain FSDP2 "
        "on this machine"
    )
    pcie_p2p = [_gpu(r, NODE[:2], r, atomics=(r == 0, r == 1)) for r in range(2)]
    assert device_refusal(pcie_p2p) == (
        "rank 0's GPU has no native atomic adds into rank 1's GPU (peer-to-peer over PCIe rather than NVLink); the "
        f"'cuda' ODC transport's atomic reduction adds gradients with them. {ordered}"
    )
    unknown = [_gpu(r, NODE[:2], r, atomics=(True, None) if r == 0 else (True, True)) for r in range(2)]
    assert device_refusal(unknown).endswith(ordered)
    # the other refusals do not offer it: the ordered reduction changes nothing about peer access
    no_access = [_gpu(r, NODE[:2], r, access=(r == 0, r == 1)) for r in range(2)]
    assert "odc_reduction" not in device_refusal(no_access)


def test_backend_hosts_determinism_and_local_problems_are_refused():
    facts = [_gpu(r, NODE[:2], r) for r in range(2)]
    nccl = [facts[0], DeviceFacts(**{**facts[1].__dict__, "backend": "NCCL"})]
    reason = device_refusal(nccl)
    assert "NCCL backend" in reason and "TORCH_SYMMMEM" in reason and "set_symm_mem" in reason
    two_hosts = [facts[0], DeviceFacts(**{**facts[1].__dict__, "host": "other"})]
    assert "2 hosts" in device_refusal(two_hosts)
    deterministic = [facts[0], DeviceFacts(**{**facts[1].__dict__, "deterministic": True})]
    assert "use_deterministic_algorithms" in device_refusal(deterministic)
    other_pool = [facts[0], DeviceFacts(**{**facts[1].__dict__, "settings": (2**20, "None")})]
    assert "every rank must use the same staging_mib" in device_refusal(other_pool)
    no_gpu = [facts[0], DeviceFacts(host="node", problem="torch.cuda.is_available() is False")]
    assert device_refusal(no_gpu) == "rank 1: torch.cuda.is_available() is False"


def test_memory_is_counted_before_allocation_with_a_set_up_margin_and_shared_gpus_add_up():
    plan = plan_segment({"g": BufferSpec(numel=100 * MiB, dtype=torch.bfloat16, accumulated=True)}, 64 * MiB)
    need = plan.device_bytes + SETUP_MARGIN_BYTES
    roomy = [_gpu(r, NODE[:2], r, free_bytes=need + MiB) for r in range(2)]
    assert memory_refusal(plan, roomy) is None
    # The plan alone would fit; the set-up margin does not.
    tight = [roomy[0], DeviceFacts(**{**roomy[1].__dict__, "free_bytes": plan.device_bytes + MiB})]
    reason = memory_refusal(plan, tight)
    assert reason.startswith("rank 1 need(s)") and f"{need / MiB:.1f} MiB" in reason and STAGING_ENV in reason
    assert f"{(plan.device_bytes + MiB) / MiB:.1f} MiB is free" in reason and "set-up margin" in reason
    shared = [_gpu(r, ("GPU-a",), 0, allow_overlap=True, free_bytes=need + MiB) for r in range(2)]
    reason = memory_refusal(plan, shared)
    assert reason and "ranks [0, 1] (one GPU)" in reason and f"{2 * need / MiB:.1f} MiB" in reason


# ------------------------------------------------------------------------------------------- on this CPU machine
@pytest.fixture
def one_rank_group():
    store = dist.HashStore()
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_capability_check_names_what_is_missing_on_this_machine():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; this checks the CPU-only message")
    reason = cuda_unavailable_reason(torch.device("cuda"))
    assert reason is not None and ("CUDA" in reason or "cuda" in reason)
    assert "not cuda" in cuda_unavailable_reason(torch.device("cpu"))
    facts = local_device_facts(torch.device("cuda"))
    assert facts.problem == reason
    assert device_refusal([facts]).startswith("rank 0: ")


def test_register_and_auto_refuse_on_every_rank_without_a_usable_gpu(one_rank_group, caplog):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; this checks the refusal without one")
    transport = CudaTransport(0, 1, timeout=5.0)
    with pytest.raises(RuntimeError, match="'cuda' ODC transport cannot run: rank 0: "):
        transport.register(SPECS)
    transport.close()
    assert transport.memory_report() == {}
    with caplog.at_level(logging.ERROR, logger="odc_accelerate.transport"):
        with pytest.raises(RuntimeError, match="'auto' found no usable transport for CUDA tensors: rank 0: "):
            create_transport("auto", rank=0, world_size=1, timeout=5, device=torch.device("cuda"))
    assert any("no usable transport" in r.getMessage() for r in caplog.records)


def test_register_needs_a_process_group():
    with pytest.raises(RuntimeError, match="initialised torch.distributed"):
        CudaTransport(0, 2, timeout=5.0).register(SPECS)


def test_factory_refuses_mismatched_devices_with_the_fix():
    # the alternatives are the transports that move the model's tensors (`Transport.devices`), then 'auto'
    with pytest.raises(
        ValueError, match="moves CPU tensors, but the model is on cuda; use transport='cuda' or 'auto'"
    ):
        create_transport("network", rank=0, world_size=2, timeout=5, device=torch.device("cuda"))
    with pytest.raises(
        ValueError, match="'cuda' moves CUDA tensors.* use transport='shm' or 'network' or 'hierarchical'"
    ):
        create_transport("cuda", rank=0, world_size=2, timeout=5, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="moves CPU tensors, but the model is on xpu; use plain FSDP2 on this device"):
        create_transport("shm", rank=0, world_size=2, timeout=5, device=torch.device("xpu"))
    with pytest.raises(ValueError, match="unknown ODC transport"):
        create_transport("rdma", rank=0, world_size=2, timeout=5, device=torch.device("cpu"))


def test_symmetric_memory_backend_and_multicast_switch_without_a_gpu(monkeypatch):
    from odc_accelerate._compat.torch import symm_mem

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: torch may already report a backend")
    monkeypatch.delenv("TORCH_SYMMMEM", raising=False)
    assert symm_mem.symmetric_backend(torch.device("cuda")) == "CUDA"  # torch's default
    monkeypatch.setenv("TORCH_SYMMMEM", "NCCL")
    assert symm_mem.symmetric_backend(torch.device("cuda")) == "NCCL"
    monkeypatch.setenv(symm_mem.MULTICAST_OFF_ENV, "0")
    assert symm_mem._without_multicast(lambda: os.environ[symm_mem.MULTICAST_OFF_ENV]) == "1"
    # Left set: restoring would be a second write while NCCL / gloo threads may read the environment.
    assert os.environ[symm_mem.MULTICAST_OFF_ENV] == "1"


def test_peer_atomics_query_is_unknown_without_a_driver():
    from odc_accelerate.transport.cuda.device import _p2p_native_atomics

    if torch.cuda.is_available():
        pytest.skip("a GPU driver is present")
    assert _p2p_native_atomics(0, 1) is None  # refused as "could not query", never assumed


def test_the_signal_pad_is_counted_with_the_segment_at_mapping_granularity():
    # a segment of exactly one granule: torch's signal pad, allocated with it, takes the mapping into a second one
    specs = {"p": BufferSpec(numel=SEGMENT_GRANULARITY // 4, dtype=torch.float32)}
    assert plan_segment(specs, 1 * MiB, signal_pad_bytes=0).device_bytes == SEGMENT_GRANULARITY
    assert plan_segment(specs, 1 * MiB, signal_pad_bytes=2048).device_bytes == 2 * SEGMENT_GRANULARITY
    # a torch that does not say how large its pad is: a whole granule, an upper bound
    assert plan_segment(specs, 1 * MiB).device_bytes == 2 * SEGMENT_GRANULARITY


def test_this_torch_reports_its_signal_pad_size():
    import torch.distributed._symmetric_memory as symm

    from odc_accelerate._compat.torch import symm_mem as compat

    size = compat.symmetric_signal_pad_bytes()
    if hasattr(symm, "get_signal_pad_size"):  # torch 2.13 here has it: its own figure, within one granule
        assert size == symm.get_signal_pad_size() and 0 < size <= SEGMENT_GRANULARITY
    else:
        assert size is None


# -------------------------------------------------------------------------------------- the reduction over these GPUs
def test_ordered_needs_no_peer_atomics_nor_leaves_determinism_to_refuse():
    pcie_p2p = [_gpu(r, NODE[:2], r, atomics=(r == 0, r == 1)) for r in range(2)]
    unknown = [_gpu(r, NODE[:2], r, atomics=(True, None) if r == 0 else (True, True)) for r in range(2)]
    deterministic = [_gpu(r, NODE[:2], r, deterministic=r == 1) for r in range(2)]
    for facts in (pcie_p2p, unknown, deterministic):
        assert device_refusal(facts) is not None  # the atomic reduction's refusal
        assert device_refusal(facts, atomics=False) is None  # nothing accumulated: only reads
    # the rest still applies without atomics: peers must be mappable
    no_access = [_gpu(r, NODE[:2], r, access=(r == 0, r == 1)) for r in range(2)]
    assert "peer-to-peer" in device_refusal(no_access, atomics=False)


def test_auto_reduction_chooses_ordered_where_peers_cannot_add_natively():
    auto = ReductionName.AUTO
    nvlink = [_gpu(r, NODE, r) for r in range(4)]
    assert atomics_problem(nvlink) is None
    assert choose_reduction(auto, nvlink) == (
        ReductionName.ATOMIC,
        "auto: the GPUs add into each other's memory natively",
    )
    pcie_p2p = [_gpu(r, NODE[:2], r, atomics=(r == 0, r == 1)) for r in range(2)]
    reduction, why = choose_reduction(auto, pcie_p2p)
    assert reduction == ReductionName.ORDERED
    assert why.startswith("auto: rank 0's GPU has no native atomic adds")
    assert "odc_reduction: ordered (ODC_REDUCTION" not in why  # the reason, not the refusal's advice
    unknown = [_gpu(r, NODE[:2], r, atomics=(True, None) if r == 0 else (True, True)) for r in range(2)]
    assert choose_reduction(auto, unknown)[0] == ReductionName.ORDERED
    deterministic = [_gpu(r, NODE[:2], r, deterministic=r == 1) for r in range(2)]
    reduction, why = choose_reduction(auto, deterministic)
    assert reduction == ReductionName.ORDERED and "use_deterministic_algorithms" in why
    # given explicitly, it is kept whatever the GPUs (an explicit atomic is then refused by the transport's checks)
    for facts in (nvlink, pcie_p2p):
        assert choose_reduction(ReductionName.ATOMIC, facts) == (ReductionName.ATOMIC, "set by odc_reduction")
        assert choose_reduction(ReductionName.ORDERED, facts) == (ReductionName.ORDERED, "set by odc_reduction")


def test_auto_reduction_is_atomic_where_the_transport_adds_atomically():
    from odc_accelerate.transport import TRANSPORT_CLASSES

    for name, cls in TRANSPORT_CLASSES.items():
        if name == "cuda":  # it asks its GPUs (above)
            assert not cls.adds_atomically
            continue
        transport = cls.__new__(cls)  # the base class's choice reads nothing of the transport's state
        assert cls.adds_atomically and transport.choose_reduction(ReductionName.AUTO) == (
            ReductionName.ATOMIC,
            f"auto: the {name} transport adds atomically",
        )
        assert transport.choose_reduction(ReductionName.ORDERED) == (ReductionName.ORDERED, "set by odc_reduction")

    class Unlocked(TRANSPORT_CLASSES["shm"]):  # a transport whose adds may race: auto must not add into peers
        adds_atomically = False

    assert Unlocked.__new__(Unlocked).choose_reduction(ReductionName.AUTO)[0] == ReductionName.ORDERED


def test_the_trainer_banner_names_the_reduction_and_why(caplog):
    from types import SimpleNamespace

    from odc_accelerate.config import ODCConfig
    from odc_accelerate.engine.report import EngineReport
    from odc_accelerate.integrations.trainer.run import ODCRun
    from odc_accelerate.integrations.trainer.setup import ODCAcceleratorSetup

    why = "auto: rank 0's GPU has no native atomic adds into rank 1's GPU"
    report = EngineReport(
        transport="cuda",
        transport_reason="auto: CUDA tensors, every rank on one host",
        accumulate_path="kernel",
        accumulate_reason="Triton compiled and ran",
        reduction=ReductionName.ORDERED,
        reduction_reason=why,
        param_groups=4,
        frozen=False,
        ranks=2,
        replicas=1,
        replicate_buckets=0,
        memory_policy="neither",
        memory="neither x4",
    )
    engine = SimpleNamespace(report=lambda: report)
    trainer = SimpleNamespace(
        odc_config=ODCConfig(enable=True),
        odc_run=ODCRun(samples_per_step=4, folded_accumulation=1, max_tokens_per_microbatch=64),
        is_world_process_zero=lambda: True,
        odc_engine=engine,
        args=SimpleNamespace(world_size=2, per_device_train_batch_size=2),
        odc_plans_from_dataset=True,
    )
    with caplog.at_level(logging.WARNING, logger="odc_accelerate.integrations.trainer.setup"):
        ODCAcceleratorSetup._odc_banner(trainer)
    # every part comes from the engine's report
    assert (
        "ODC on: transport cuda (auto: CUDA tensors, every rank on one host; gradients accumulate by kernel (Triton "
        "compiled and ran)), plan free," in caplog.text
    )
    assert f"memory policy neither (rank 0: neither x4); gradient reduction ordered ({why}); metrics" in caplog.text


def test_the_plugin_passes_the_reduction_unchanged(monkeypatch):
    from types import SimpleNamespace

    from odc_accelerate import engine as engine_module
    from odc_accelerate.config import ODCConfig
    from odc_accelerate.integrations import accelerate as plugin_module

    seen = []

    class Accelerator:  # the plugin keeps engines by accelerator, weakly
        def __init__(self, plugin):
            self.state = SimpleNamespace(fsdp_plugin=plugin)
            self.gradient_state = SimpleNamespace(plugin_kwargs={})  # no sync_each_batch
            self.is_main_process = False  # no banner

    class Engine:
        param_groups: list = []

        def __init__(self, model, **kwargs):
            seen.append(kwargs["reduction"])

    monkeypatch.setattr(engine_module, "ODCEngine", Engine)
    for config, expected in (
        (ODCConfig(enable=True), "auto"),  # the default: the transport chooses
        (ODCConfig.from_sources(env={"ODC_ENABLE": "true", "ODC_REDUCTION": "atomic"}), "atomic"),
        (ODCConfig.from_sources(env={"ODC_ENABLE": "true", "ODC_REDUCTION": "ordered"}), "ordered"),
    ):
        plugin = plugin_module.ODCPlugin(fsdp_version=2, odc_config=config)
        plugin_module._attach_engine(Accelerator(plugin), object())
        assert seen[-1] == expected
