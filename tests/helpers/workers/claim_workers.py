"""Per-rank functions for the claim-counter tests (run through :func:`odc_accelerate.testing.launch`).

Every counter is exercised by real processes: the transports' own (``shm``, ``network``, ``hierarchical``, the
``cuda`` transport's protocol on CPU) and the ``torch.distributed`` store fallback.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from odc_accelerate.transport import BufferSpec, ODCTimeoutError, create_transport
from odc_accelerate.transport.claims import StoreClaimCounter, claim_counter, claim_indices

BACKENDS = ("shm", "network", "hierarchical", "cuda-on-cpu", "store")


def _transport(backend: str, rank: int, world_size: int, timeout: float) -> Any:
    """The transport whose barrier ends each round (the store fallback uses ``shm``'s barrier)."""
    if backend == "cuda-on-cpu":
        from tests.gpu.check_common import CpuSegmentsCudaTransport

        transport = CpuSegmentsCudaTransport(rank, world_size, timeout=timeout)
    else:
        if backend == "hierarchical":
            os.environ["ODC_HOST_ID"] = "one-host"  # both ranks on one "host": shm inside, the counter over TCP
        name = "shm" if backend == "store" else backend
        transport = create_transport(
            name, rank=rank, world_size=world_size, timeout=timeout, device=torch.device("cpu")
        )
    transport.register({"x": BufferSpec(numel=4, dtype=torch.float32, accumulated=True)})
    return transport


def _counter(backend: str, transport: Any) -> Any:
    counter = claim_counter(None if backend == "store" else transport)
    expected = StoreClaimCounter if backend == "store" else type(transport)
    assert isinstance(counter, expected), (backend, type(counter))
    return counter


def exactly_once(rank: int, world_size: int, flag_dir: str) -> dict[str, Any]:
    """Per backend, several rounds on one counter; returns the indices this rank claimed in each round.

    * ``race``: 600 indices, both ranks claiming at once (the counter under contention): after its first claim each
      rank waits until its peer has claimed one too, so that both take part whatever the machine's load;
    * ``slow``: 24 indices, rank 1 waiting after its first claim until rank 0 has found the counter exhausted (a much
      slower rank, by construction: it claims at most one);
    * ``none``: 6 indices, rank 1 claims only after rank 0 has found the counter exhausted (a rank that claims none);
    * ``empty``: a round of 0 indices;
    * ``again``: the next round starts at 0 again (``race`` repeated).
    """
    out: dict[str, Any] = {}
    round_no = 0
    for backend in BACKENDS:
        transport = _transport(backend, rank, world_size, 60.0)
        counter = _counter(backend, transport)
        got: dict[str, list[int]] = {}
        for case, count in (("race", 600), ("slow", 24), ("none", 6), ("empty", 0), ("again", 600)):
            round_no += 1
            flag = Path(flag_dir) / f"{backend}-{case}.done"
            if case == "none" and rank == 1:
                _wait_for(flag)
            mine = []
            for index in claim_indices(counter, round_no, count):
                mine.append(index)
                if case == "slow" and rank == 1:
                    _wait_for(flag)
                elif case in ("race", "again"):
                    if len(mine) == 1:
                        (Path(flag_dir) / f"{backend}-{case}-rank{rank}.first").touch()
                        _wait_for(Path(flag_dir) / f"{backend}-{case}-rank{1 - rank}.first")
                    time.sleep(2e-4)  # a little work per index, so that both ranks are claiming at once
            if rank == 0:
                flag.touch()
            got[case] = mine
            transport.barrier()  # the step's barrier: every claim of this round is done on every rank
        out[backend] = got
        transport.close()
    return out


def _wait_for(path: Path, timeout: float = 60.0) -> None:
    """Wait until ``path`` exists (a peer's signal); a peer that never sends it fails the test, naming the file."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {timeout} s")
        time.sleep(0.005)


def killed_after_claiming(rank: int, world_size: int, backend: str, record_dir: str) -> dict[str, Any]:
    """Rank 1 claims two indices, records them, and is killed (SIGKILL) before running them; rank 0 claims the rest
    and reaches the barrier, which must fail naming rank 1."""
    transport = _transport(backend, rank, world_size, 30.0)
    counter = _counter(backend, transport)
    transport.barrier()
    count = 20
    claimed = []
    for index in claim_indices(counter, 1, count):
        claimed.append(index)
        if rank == 1 and len(claimed) == 2:
            Path(record_dir, "rank1.claims").write_text(",".join(map(str, claimed)))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.01)
    try:
        transport.barrier()
        error, ranks = None, None
    except ODCTimeoutError as err:
        error, ranks = str(err), err.ranks
    return {"claimed": claimed, "error": error, "ranks": ranks}
