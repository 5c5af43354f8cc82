"""Device-independent logic of the CUDA transport, on CPU (the GPU path itself is unverified here)."""

import pytest
import torch

from odc_accelerate.transport import BufferSpec, CudaTransport, create_transport
from odc_accelerate.transport.cuda import ALIGN, StagedBuffers, StagingLayout, cuda_unavailable_reason, slot_index

SPECS = {
    "p0": BufferSpec(numel=10, dtype=torch.bfloat16),
    "g0": BufferSpec(numel=7, dtype=torch.float32, accumulated=True),
    "touched": BufferSpec(numel=3, dtype=torch.uint8),
    "g1": BufferSpec(numel=300, dtype=torch.float32, accumulated=True),
}


def test_slot_index_gives_each_sender_its_own_slot():
    for world in (2, 3, 8):
        for owner in range(world):
            slots = [slot_index(owner, s) for s in range(world) if s != owner]
            assert sorted(slots) == list(range(world - 1))
    with pytest.raises(ValueError, match="no staging slot"):
        slot_index(2, 2)


def test_layout_regions_are_aligned_disjoint_and_only_for_staged_buffers():
    world = 4
    layout = StagingLayout(SPECS, world)
    assert layout.staged_names == ["g0", "g1"]
    regions = [(layout.offsets[n], SPECS[n].nbytes) for n in SPECS]
    for name in layout.staged_names:
        for owner in range(world):
            regions += [(layout.slot_offset(name, owner, s), SPECS[name].nbytes) for s in range(world) if s != owner]
    spans = sorted({(start, start + size) for start, size in regions})
    assert all(start % ALIGN == 0 for start, _ in spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] <= layout.total_bytes
    with pytest.raises(KeyError, match="not staged"):
        layout.slot_offset("p0", 0, 1)


def test_staged_adds_and_owner_reduction_are_exact_and_ordered():
    # Simulate 3 ranks' segments in one process (on GPUs these are symmetric-memory mappings).
    world = 3
    layout = StagingLayout(SPECS, world)
    segments = [torch.zeros(layout.total_bytes, dtype=torch.uint8) for _ in range(world)]
    ranks = [StagedBuffers(layout, r, segments) for r in range(world)]
    for step in range(2):
        for r, data in enumerate(ranks):
            for owner in range(world):
                for _ in range(step + 1):
                    data.accumulate(owner, "g1", torch.full((300,), float(r + 1)))
            if r != 0:
                data.accumulate(0, "g0", torch.arange(7, dtype=torch.float32))
        # before the owner reduces, peers' adds sit in their slots, not in the owner's buffer
        assert torch.equal(ranks[0].views[0]["g1"], torch.full((300,), 1.0 * (step + 1)))
        for owner, data in enumerate(ranks):
            ledgers = {s: ranks[s].sent[owner].clone() for s in range(world) if s != owner}
            dirty = data.dirty(ledgers)
            expected = [("g1", s) for s in range(world) if s != owner]
            if owner == 0:
                expected = [("g0", 1), ("g0", 2)] + expected
            assert dirty == expected  # buffer order, then sender order: a fixed reduction order
            data.reduce(dirty)
            assert data.dirty(ledgers) == []  # nothing new since
        for owner, data in enumerate(ranks):
            assert torch.equal(data.views[owner]["g1"], torch.full((300,), 6.0 * (step + 1)))
            for sender in range(world):
                if sender != owner:
                    assert not data.incoming[sender]["g1"].any()  # slots zeroed for the next step
            data.views[owner]["g1"].zero_()
        assert torch.equal(ranks[0].views[0]["g0"], 2 * torch.arange(7, dtype=torch.float32))
        ranks[0].views[0]["g0"].zero_()
    # reads are one-sided copies of the peer's published buffer
    ranks[2].views[2]["p0"].fill_(1.5)
    out = torch.empty(10, dtype=torch.bfloat16)
    ranks[0].read(2, "p0", out)
    assert torch.equal(out, torch.full((10,), 1.5, dtype=torch.bfloat16))
    with pytest.raises(KeyError, match="not staged"):
        ranks[0].accumulate(1, "p0", out)


def test_capability_check_names_what_is_missing_on_this_machine():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; this checks the CPU-only message")
    reason = cuda_unavailable_reason(torch.device("cuda"))
    assert reason is not None
    assert "CUDA" in reason or "cuda" in reason
    assert "not cuda" in cuda_unavailable_reason(torch.device("cpu"))
    transport = CudaTransport(0, 2, timeout=5.0)
    with pytest.raises(RuntimeError, match="'cuda' ODC transport cannot run"):
        transport.register(SPECS)


def test_factory_refuses_mismatched_devices_with_the_fix():
    with pytest.raises(ValueError, match="use transport='cuda'"):
        create_transport("network", rank=0, world_size=2, timeout=5, device=torch.device("cuda"))
    with pytest.raises(ValueError, match="needs a model on CUDA"):
        create_transport("cuda", rank=0, world_size=2, timeout=5, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown ODC transport"):
        create_transport("rdma", rank=0, world_size=2, timeout=5, device=torch.device("cpu"))
