"""Two processes add into one shared-memory tensor with the accumulate kernel (Triton's interpreter, CPU tensors) at
the same time: the exact sum, as ranks add into one owner's accumulator on GPUs."""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid

import pytest
import torch

from odc_accelerate.transport.cuda.kernels import BLOCK, INTERPRETER_PROGRAMS

pytest.importorskip("triton", reason="Triton runs the kernel (the 'testing' extra installs it)")

# More whole blocks than the interpreter's programs, so that one program loops over two of them, and a ragged tail
WHOLE_BLOCKS = INTERPRETER_PROGRAMS + 1
NUMEL = WHOLE_BLOCKS * BLOCK + 5
ROUNDS = 12


def _source(rank: int) -> torch.Tensor:
    # Multiples of 1/8 up to 8 in magnitude: exact in bf16 and in any fp32 partial sum, so that the order in which
    # the two processes' adds land cannot change the result; only a lost update can.
    gen = torch.Generator().manual_seed(rank)
    return (torch.randint(-64, 65, (NUMEL,), generator=gen).float() / 8).to(torch.bfloat16)


def _adder(path: str, rank: int, start: mp.Barrier) -> None:
    from odc_accelerate.transport.cuda.kernels import accumulate_

    torch.set_num_threads(1)
    shared = torch.from_file(path, shared=True, size=NUMEL, dtype=torch.float32)
    src = _source(rank)
    start.wait(timeout=60)  # both processes add at the same time
    for _ in range(ROUNDS):
        accumulate_(shared, src)


def test_two_processes_adding_into_one_shared_tensor_give_the_exact_sum():
    # the sizes cover the kernel's three code paths: the unmasked loop, a program's second pass through it, the tail
    assert NUMEL // BLOCK == WHOLE_BLOCKS > INTERPRETER_PROGRAMS and NUMEL % BLOCK
    path = f"/dev/shm/odc-accumulate-kernel-{uuid.uuid4().hex}"
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=_adder, args=(path, rank, start)) for rank in range(2)]
    try:
        torch.from_file(path, shared=True, size=NUMEL, dtype=torch.float32).zero_()
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        assert [p.exitcode for p in procs] == [0, 0]
        result = torch.from_file(path, shared=False, size=NUMEL, dtype=torch.float32)
        expected = (_source(0).double() + _source(1).double()) * ROUNDS
        assert torch.equal(result.double(), expected)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if os.path.exists(path):
            os.unlink(path)
    assert not os.path.exists(path)


def test_the_accumulate_paths_benchmark_runs_tiny_on_cpu():
    from tests.gpu.accumulate_bench import PATHS, measure

    out = measure("cpu", sizes_mib=[1 / 64, 1 / 32], iters=2, sm_shares=[0.5, 1.0], timeout=240)
    assert out["checks"] and all(out["checks"].values()), out["checks"]
    for rank in out["ranks"]:
        assert [(row["mib"], row["src_dtype"]) for row in rank["sizes"]] == [
            (m, d) for m in (1 / 64, 1 / 32) for d in ("float32", "bfloat16")
        ]
        assert all(set(row["GBps"]) == set(PATHS) and min(row["GBps"].values()) > 0 for row in rank["sizes"])
        assert [(g["src_dtype"], g["sm_share"]) for g in rank["grid"]] == [
            (d, s) for d in ("float32", "bfloat16") for s in (0.5, 1.0)
        ]
    assert len(out["ratios_largest_size"]) == 4  # 2 ranks x 2 source dtypes


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "index_add_"])
def test_the_cuda_transport_protocol_accumulates_exactly_on_either_path(kernel):
    # The 'cuda' transport's protocol over shared memory: the kernel (Triton's interpreter) stages nothing; the
    # index_add_ fallback (accumulate_kernel=False) reports its staging pool.
    from odc_accelerate.testing import launch
    from tests.gpu.accumulate_bench import transport_paths_worker

    ranks = launch(transport_paths_worker, 2, {"numel": 5000, "kernel": kernel}, env={"TRITON_INTERPRET": "1"})
    assert all(r["exact"] for r in ranks)
    assert {r["path"] for r in ranks} == {"kernel" if kernel else "index_add_"}
    staging = [r["report"]["staging"] for r in ranks]
    assert staging == [0, 0] if kernel else all(s >= 5000 * 8 for s in staging)  # int32 index + fp32 cast chunk


def test_a_kernel_failing_its_set_up_probe_on_one_rank_sends_every_rank_to_index_add_():
    # Rank 1 cannot build the kernel (as where Triton finds no C compiler): its set-up probe fails, the ranks learn it
    # with their device facts, and both add with the fallback, naming rank 1's reason; nothing fails at the first add.
    from odc_accelerate.testing import launch
    from tests.gpu.accumulate_bench import transport_paths_worker

    spec = {"numel": 5000, "kernel": True, "broken_kernel_rank": 1}
    ranks = launch(transport_paths_worker, 2, spec, env={"TRITON_INTERPRET": "1"})
    assert [r["path"] for r in ranks] == ["index_add_", "index_add_"]
    assert ranks[0]["reason"] == ranks[1]["reason"]
    assert ranks[0]["reason"].startswith("rank 1: the accumulate kernel failed its set-up probe"), ranks[0]["reason"]
    assert "Failed to find C compiler" in ranks[0]["reason"]
    assert all(r["exact"] for r in ranks)
    assert all(r["report"]["staging"] >= 5000 * 8 for r in ranks)  # the fallback's pool, planned on both ranks
