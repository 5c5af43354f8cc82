"""The parity cases of the GPU check: ``parity`` and ``ranks8``.

* ``parity``: the toy LM with unequal microbatch counts per rank (1 and 4) against one process summing the same
  microbatches: fp32 (gradients and parameters after 3 AdamW steps); bf16 parameters with an fp32 reduce dtype;
  bf16 parameters with a bf16 reduce dtype, accumulated in fp32 (the default) and in bf16; ``auto`` picks the
  transport and its kernel;
* ``ranks8``: 8 processes on the one GPU: the fp32 parity with 0 to 3 microbatches per rank (`PLAN8`), the same steps
  under the ``dynamic`` plan (every microbatch claimed exactly once, the same parameters), the claim counter with 8
  ranks claiming at once, and 7 ranks adding into one owner's accumulators at once, exact against the sum.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch

from odc_accelerate.testing import launch
from odc_accelerate.transport import BufferSpec, CudaTransport, ShmTransport

from .check_common import (
    OVERLAP_ENV,
    PLAN,
    SMALL,
    CpuSegmentsCudaTransport,
    compare_to_reference,
    rank_device,
    reference,
    train_worker,
)

#: the eight-rank case: 8 processes on the one device
RANKS8 = 8


# 3 steps x 8 ranks: 0 to 3 microbatches per rank, two ranks with none in every step
PLAN8 = [
    [[12], [9, 15, 7], [], [11, 5], [16], [8, 13, 6], [], [10]],
    [[5, 14], [], [9], [13, 7, 11], [6], [], [15, 8], [12]],
    [[], [16], [10, 4], [7], [9, 12, 5], [14], [11], []],
]


def _own_transport(name: str, rank: int, world_size: int, device: torch.device):
    """A transport instance for the transport-level workers: ``cuda`` (the GPU), ``cuda-on-cpu`` (its protocol over
    shared memory) or ``shm``."""
    if name == "cuda":
        return CudaTransport(rank, world_size, timeout=120.0, device=device)
    if name == "cuda-on-cpu":
        return CpuSegmentsCudaTransport(rank, world_size, timeout=120.0)
    if name == "shm":
        return ShmTransport(rank, world_size, timeout=120.0)
    raise ValueError(f"unknown transport {name!r} for a transport-level worker")


def _small_integers(seed: int, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Integers in [-8, 8]: a sum of a few hundred of them is exact in bf16 and fp32, whatever the order of the adds."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(-8, 9, (numel,), generator=gen, dtype=torch.int32).to(dtype).to(device)


def _wait_for(path: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{os.path.basename(path)} did not appear within {timeout:.0f} s")
        time.sleep(0.002)


def transport8_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Claims and concurrent adds through one transport, every rank at once.

    * claims (the ``dynamic`` plan's counter, `claims.claim_counter`), one round each: ``race`` (800 indices; after
      its first claim each rank waits until every peer has claimed one, so that all take part), ``none`` (6 indices
      that rank 0 drains before any other rank starts: they claim none), ``empty`` (0 indices) and ``again`` (the next
      round starts at 0: ``race`` once more). Returns the indices this rank claimed in each round;
    * adds: every rank but ``spec["owner"]`` adds its own source into the owner's accumulators ``spec["iters"]``
      times, an fp32 and a bf16 source, all senders at once (one barrier before). The sources are small integers
      (`_small_integers`), so the owner's sums must equal the exact one; every other rank's accumulators must still be
      zero.
    """
    from odc_accelerate.transport.claims import claim_counter, claim_indices

    device = rank_device(spec["device"])
    transport = _own_transport(spec["transport"], rank, world_size, device)
    numel, iters, owner = spec["numel"], spec["iters"], spec["owner"]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    own = transport.register({name: BufferSpec(numel=numel, dtype=d, accumulated=True) for name, d in dtypes.items()})
    out: dict[str, Any] = {"transport": transport.name, "accumulate_path": getattr(transport, "accumulate_path", None)}

    counter = claim_counter(transport)
    out["counter"] = type(counter).__name__
    flags = spec["flag_dir"]
    claims: dict[str, list[int]] = {}
    for round_no, (case, count) in enumerate((("race", 800), ("none", 6), ("empty", 0), ("again", 800)), start=1):
        if case == "none" and rank != 0:
            _wait_for(os.path.join(flags, "none.drained"))
        mine = []
        for index in claim_indices(counter, round_no, count):
            mine.append(index)
            if case in ("race", "again"):
                if len(mine) == 1:
                    open(os.path.join(flags, f"{case}.rank{rank}"), "w").close()
                    for peer in range(world_size):
                        _wait_for(os.path.join(flags, f"{case}.rank{peer}"))
                time.sleep(1e-4)  # a little work per index: the ranks claim at the same time
        if case == "none" and rank == 0:
            open(os.path.join(flags, "none.drained"), "w").close()
        claims[case] = mine
        transport.barrier()  # the step's barrier: every claim of this round is done on every rank
    out["claims"] = claims

    transport.barrier()  # every sender starts at once
    if rank != owner:
        for name, dtype in dtypes.items():
            src = _small_integers(rank, numel, dtype, device)
            for _ in range(iters):
                transport.accumulate(owner, name, src)
    transport.barrier()  # every add issued before it has landed
    for name, dtype in dtypes.items():
        got = own[name].double().cpu()
        if rank == owner:
            senders = [r for r in range(world_size) if r != owner]
            expected = sum(_small_integers(r, numel, dtype, "cpu").double() for r in senders) * iters
            out[name] = {
                "exact": bool(torch.equal(got, expected)),
                "max_abs_err": float((got - expected).abs().max()),
                "accumulator_dtype": str(own[name].dtype).removeprefix("torch."),
            }
        else:
            out[name] = {"untouched": not bool(got.any())}
    out["accumulate_path"] = getattr(transport, "accumulate_path", None)
    transport.barrier()
    del own
    transport.close()
    return out


def case_parity(device: str) -> dict[str, Any]:
    env = {OVERLAP_ENV: "1"}
    if device == "cpu":  # the accumulate kernel runs on CPU tensors under Triton's interpreter (fp32 accumulators)
        env["TRITON_INTERPRET"] = "1"
    # The 'cuda' transport accumulating in fp32 (its default) and in bf16; on CPU its protocol over shared memory.
    wide, narrow = ("auto", "cuda-bf16-acc") if device == "cuda" else ("cuda-on-cpu", "cuda-on-cpu-bf16-acc")
    runs = {"fp32": ["auto", wide], "bf16-fp32-reduce": [wide], "bf16": [wide, narrow]}
    out: dict[str, Any] = {}
    for precision, transports in runs.items():
        spec = dict(device=device, cfg=SMALL, plan=PLAN, precision=precision)
        ref = reference(spec)
        for name in dict.fromkeys(transports):
            ranks = launch(train_worker, 2, {**spec, "transport": name}, timeout=300, env=env)
            out[f"{precision}/{name}"] = {
                "transport": ranks[0]["transport"],
                "accumulate_path": ranks[0]["accumulate_path"],
                "grad": compare_to_reference([r["grads"] for r in ranks], ref["grads"], 2),
                "params_after_3_steps": compare_to_reference([r["params"] for r in ranks], ref["params"], 2),
                "memory_report": ranks[0]["memory_report"],
            }
    checks = {}
    for name in dict.fromkeys(runs["fp32"]):
        res = out[f"fp32/{name}"]
        checks[f"fp32 gradients, {res['transport']} (rel < 1e-5)"] = res["grad"]["rel"] < 1e-5
        checks[f"fp32 parameters after 3 AdamW steps, {res['transport']} (max abs < 1e-4)"] = (
            res["params_after_3_steps"]["max_abs"] < 1e-4
        )
    # bf16 compute with an fp32 reduce dtype checks the reference itself (same bf16 gradients, summed in fp32).
    checks["bf16 params, fp32 reduce dtype: gradients (rel < 1e-4)"] = (
        out[f"bf16-fp32-reduce/{wide}"]["grad"]["rel"] < 1e-4
    )
    checks["bf16 reduce dtype, accumulated in fp32 (default): gradients (rel < 1e-4)"] = (
        out[f"bf16/{wide}"]["grad"]["rel"] < 1e-4
    )
    checks["fp32 accumulation closer to the exact sum than bf16 accumulation"] = (
        out[f"bf16/{wide}"]["grad"]["rel"] < out[f"bf16/{narrow}"]["grad"]["rel"]
    )
    if device == "cuda":
        checks["'auto' picked the cuda transport"] = out["fp32/auto"]["transport"] == "cuda"
        checks["the engine's 'auto' accumulates with the kernel"] = out["fp32/auto"]["accumulate_path"] == "kernel"
    out["checks"] = checks
    return out


def case_ranks8(device: str, transports: list[str] | None = None) -> dict[str, Any]:
    """Eight ranks on the one device (on a GPU: 8 processes sharing it over gloo).

    Per transport (on a GPU the engine's ``auto``, i.e. ``cuda``; on CPU the 'cuda' transport's protocol over shared
    memory): the toy LM with 0 to 3 microbatches per rank (`PLAN8`) against one process summing the same
    microbatches (fp32 gradients and parameters after 3 AdamW steps); the same steps under the ``dynamic`` plan (each
    step's microbatches claimed from one queue while the step runs): every microbatch claimed exactly once, and the
    same parameters; the claim counter with 8 ranks claiming at once; 7 ranks adding into one owner's accumulators
    at once, exact against the sum computed here.
    """
    env = {OVERLAP_ENV: "1"}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    names = transports or (["auto"] if device == "cuda" else ["cuda-on-cpu"])
    spec = dict(device=device, cfg=SMALL, plan=PLAN8, precision="fp32")
    ref = reference(spec)
    queue_lengths = [sum(len(mbs) for mbs in step) for step in PLAN8]
    out: dict[str, Any] = {"plan_microbatches_per_rank": [[len(mbs) for mbs in step] for step in PLAN8]}
    checks: dict[str, bool] = {}
    with tempfile.TemporaryDirectory(prefix="odc_ranks8_") as flags:
        for name in names:
            static = launch(train_worker, RANKS8, {**spec, "transport": name}, timeout=300, env=env)
            dynamic = launch(train_worker, RANKS8, {**spec, "transport": name, "dynamic": True}, timeout=300, env=env)
            own = "cuda" if name == "auto" else name.removesuffix("-bf16-acc")
            flag_dir = os.path.join(flags, own)
            os.makedirs(flag_dir)
            numel = 3 * 2**20 + 12345 if device == "cuda" else 40_003  # several staging chunks, no round size
            tspec = dict(device=device, transport=own, numel=numel, iters=3, owner=3, flag_dir=flag_dir)
            ranks = launch(transport8_worker, RANKS8, tspec, timeout=300, env=env)
            t = static[0]["transport"]
            claimed = [[r["claimed"][step] for r in dynamic] for step in range(len(PLAN8))]
            res = out[t] = {
                "accumulate_path": static[0]["accumulate_path"],
                "grad": compare_to_reference([r["grads"] for r in static], ref["grads"], RANKS8),
                "params_after_3_steps": compare_to_reference([r["params"] for r in static], ref["params"], RANKS8),
                "dynamic_params_after_3_steps": compare_to_reference(
                    [r["params"] for r in dynamic], ref["params"], RANKS8
                ),
                "dynamic_claimed_per_rank": [[len(c) for c in step] for step in claimed],
                "claims_per_rank": {c: [len(r["claims"][c]) for r in ranks] for c in ("race", "none", "again")},
                "counter": ranks[0]["counter"],
                "accumulate_into_one": {k: ranks[tspec["owner"]][k] for k in ("fp32", "bf16")},
                "transport_accumulate_path": ranks[0]["accumulate_path"],
            }
            checks[f"8 ranks, 0 to 3 microbatches each: fp32 gradients, {t} (rel < 1e-5)"] = res["grad"]["rel"] < 1e-5
            checks[f"8 ranks: fp32 parameters after 3 AdamW steps, {t} (max abs < 1e-4)"] = (
                res["params_after_3_steps"]["max_abs"] < 1e-4
            )
            checks[f"dynamic plan, 8 ranks: every microbatch claimed exactly once in every step, {t}"] = all(
                sorted(i for rank in step for i in rank) == list(range(n))
                for step, n in zip(claimed, queue_lengths, strict=True)
            )
            checks[f"dynamic plan, 8 ranks: parameters after 3 AdamW steps, {t} (max abs < 1e-4)"] = (
                res["dynamic_params_after_3_steps"]["max_abs"] < 1e-4
            )
            rounds = {c: [r["claims"][c] for r in ranks] for c in ("race", "none", "empty", "again")}
            checks[f"claims, 8 ranks at once: every index exactly once, each rank's in increasing order, {t}"] = all(
                sorted(i for mine in rounds[c] for i in mine) == list(range(800))
                and all(mine and mine == sorted(mine) for mine in rounds[c])
                for c in ("race", "again")
            )
            checks[f"claims: ranks starting after the queue is drained get none; an empty round gives none, {t}"] = (
                rounds["none"][0] == list(range(6)) and not any(rounds["none"][1:]) and not any(rounds["empty"])
            )
            for dtype in ("fp32", "bf16"):
                checks[f"7 ranks adding into one owner's accumulator at once: exact, {dtype} source, {t}"] = ranks[
                    tspec["owner"]
                ][dtype]["exact"]
            checks[f"7 ranks adding into one owner's: no other rank's accumulator touched, {t}"] = all(
                r[d]["untouched"] for i, r in enumerate(ranks) if i != tspec["owner"] for d in ("fp32", "bf16")
            )
    out["checks"] = checks
    return out
