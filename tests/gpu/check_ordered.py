"""The ``ordered`` case of the GPU check: the ordered gradient reduction against ``atomic`` on the toy LM.

Unequal microbatch counts per rank; step time of each, two engines in one launch stepping in turn (``atomic
ordered``, then ``ordered atomic``, ...: the median of each one's steps after a warm-up; the ordered exchange's time
and bytes from the engine's `StepStats`), the parameters of the two equal to rounding, and two further ``ordered`` runs,
each in fresh processes with deterministic algorithms on and a different rank slowed at random microbatches, ending
with bitwise-identical parameters (a SHA-256 of every parameter shard on every rank).
"""

from __future__ import annotations

import hashlib
import random
import statistics
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from odc_accelerate.testing import launch
from odc_accelerate.testing.models import ToyConfig, build_model, make_steps, shard_model, token_loss_sum

from .check_common import (
    MEDIUM,
    OVERLAP_ENV,
    SMALL,
    compare_to_reference,
    local_array,
    make_transport,
    math_sdpa,
    precision_policy,
    rank_device,
    sync_device,
)

#: the ordered case: per device, the model, the microbatch lengths of rank 0 and rank 1 in every step, and the steps
#: (the first is a warm-up, not timed). Unequal counts per rank: each owner sums a 1-microbatch and a 3-microbatch
#: contribution. The CPU sizes keep the dry run short; its times are the harness's, not a measurement.
ORDERED = {
    "cuda": dict(cfg=MEDIUM, lengths=[[512], [384, 256, 448]], steps=9),
    "cpu": dict(cfg=SMALL, lengths=[[12], [9, 15, 7]], steps=3),
}


def param_hashes(model: torch.nn.Module) -> dict[str, str]:
    """SHA-256 of this rank's shard of every parameter, bit for bit."""
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        data = local.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        out[name] = hashlib.sha256(data).hexdigest()
    return out


def ordered_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train the toy LM under each reduction of ``spec["reductions"]``, one engine each, stepping in turn.

    Step ``i`` runs every engine once, in the order of ``spec["reductions"]`` for even ``i`` and reversed for odd ``i``
    (``A B``, ``B A``, ...), so that neither runs always first. A step is timed the same way for every engine: from a
    barrier with the device synchronised to the end of ``post_optimizer_step`` (its closing barrier) with the device
    synchronised. ``spec["slow_rank"]``: that rank sleeps 0 to 20 ms (a seeded random draw) after some microbatches,
    so that the ranks reach the step boundary in varying order. ``spec["deterministic"]``: deterministic algorithms on
    (``warn_only``: an op without a deterministic version warns), which the ``atomic`` reduction refuses on a GPU.
    Returns per reduction: step times, the engine's exchange time and bytes read per step, the hash of every
    parameter shard before and after training, and the shards themselves.
    """
    from odc_accelerate.engine import ODCEngine
    from odc_accelerate.loss import loss_scale

    device = rank_device(spec["device"])
    if spec.get("deterministic"):
        torch.use_deterministic_algorithms(True, warn_only=True)
    cfg = ToyConfig(**spec["cfg"])
    reductions = list(spec["reductions"])
    arms: dict[str, Any] = {}
    for reduction in reductions:
        model = shard_model(build_model(cfg, seed=0).to(device), mp_policy=precision_policy("fp32"))
        transport = make_transport(spec, rank, world_size, device)
        engine = ODCEngine(model, transport=transport, reduction=reduction, timeout=120.0)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        arms[reduction] = {"model": model, "engine": engine, "optim": optim, "initial": param_hashes(model)}
    plan = [spec["lengths"]] * spec["steps"]
    slow = random.Random(spec.get("seed", 0))
    figures: dict[str, dict[str, list]] = {r: {"step_s": [], "exchange_s": [], "bytes_read": []} for r in reductions}
    with math_sdpa():
        for index, step in enumerate(make_steps(plan, cfg.vocab, seed=1)):
            n_global = sum(ids.shape[1] - 1 for mbs in step for ids in mbs)
            for reduction in reductions if index % 2 == 0 else reversed(reductions):
                arm = arms[reduction]
                model, engine, optim = arm["model"], arm["engine"], arm["optim"]
                sync_device(device)
                dist.barrier()
                start = time.perf_counter()
                for ids in step[rank]:
                    loss, _ = token_loss_sum(model, ids.to(device))
                    (loss * loss_scale(n_global, world_size)).backward()
                    if rank == spec.get("slow_rank") and slow.random() < 0.5:
                        time.sleep(slow.uniform(0.0, 0.02))
                engine.pre_optimizer_step()
                optim.step()
                optim.zero_grad()
                engine.post_optimizer_step()
                sync_device(device)
                figures[reduction]["step_s"].append(time.perf_counter() - start)
                stats = engine.last_step_stats
                figures[reduction]["exchange_s"].append(stats.exchange_s if stats is not None else None)
                figures[reduction]["bytes_read"].append(stats.bytes_read if stats is not None else None)
    out: dict[str, Any] = {"deterministic": torch.are_deterministic_algorithms_enabled()}
    for reduction, arm in arms.items():
        out[reduction] = {
            **figures[reduction],
            "reduction": str(getattr(arm["engine"].reduction, "value", arm["engine"].reduction)),
            "transport": arm["engine"].transport.name,
            "initial": arm["initial"],
            "hashes": param_hashes(arm["model"]),
            "params": {n: local_array(p) for n, p in arm["model"].named_parameters()},
        }
        arm["engine"].close()
    return out


def _gathered(ranks: list[dict[str, Any]], reduction: str) -> dict[str, np.ndarray]:
    """The full parameters of ``reduction``'s model from every rank's shard (dim-0 shards, in rank order)."""
    names = ranks[0][reduction]["params"]
    return {n: np.concatenate([r[reduction]["params"][n] for r in ranks], axis=0) for n in names}


def case_ordered(device: str) -> dict[str, Any]:
    """The ``ordered`` reduction against ``atomic`` on 2 ranks sharing the device (`ordered_worker`).

    One launch runs both reductions, stepping in turn: each one's median step time over its steps after the first (the
    same definition for both; the figures are stored, never checked), the ordered exchange's median time and bytes
    per step, and the two engines' parameters after training, equal to rounding. Two further launches run ``ordered``
    alone with deterministic algorithms on, the first with rank 1 slowed at random microbatches, the second rank 0:
    their parameters must be bitwise identical (the SHA-256 of every shard on every rank) and differ from the start.
    On a GPU the transport is the engine's ``auto`` (``cuda``); on CPU the ``cuda`` transport's protocol over shared
    memory (`CpuSegmentsCudaTransport`).
    """
    sizes = ORDERED[device]
    transport = "auto" if device == "cuda" else "cuda-on-cpu"
    env = {OVERLAP_ENV: "1"}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # the atomic reduction's accumulate kernel, interpreted on CPU tensors
    base = dict(device=device, transport=transport, cfg=sizes["cfg"], lengths=sizes["lengths"], steps=sizes["steps"])
    timed = launch(ordered_worker, 2, {**base, "reductions": ["atomic", "ordered"]}, timeout=300, env=env)
    # cuBLAS needs a fixed workspace to be deterministic (the variable is read when a process first uses cuBLAS)
    det_env = dict(env, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    runs = [
        launch(
            ordered_worker,
            2,
            {**base, "reductions": ["ordered"], "deterministic": True, "slow_rank": slow, "seed": slow},
            timeout=300,
            env=det_env,
        )
        for slow in (1, 0)
    ]

    def median_over_ranks(reduction: str, key: str) -> float:
        # a step's time is its slowest rank's (every rank leaves the closing barrier together); the warm-up dropped
        per_step = [max(values) for values in zip(*(r[reduction][key] for r in timed), strict=True)][1:]
        return statistics.median(per_step)

    step_s = {r: median_over_ranks(r, "step_s") for r in ("atomic", "ordered")}
    exchange = [max(v) for v in zip(*(r["ordered"]["exchange_s"] for r in timed), strict=True)][1:]
    out: dict[str, Any] = {
        "transport": timed[0]["ordered"]["transport"],
        "reductions_run": {r: timed[0][r]["reduction"] for r in ("atomic", "ordered")},
        "plan_microbatches_per_rank": [len(mbs) for mbs in sizes["lengths"]],
        "steps_timed": sizes["steps"] - 1,
        "step_s_median": step_s,
        "step_s_per_step": {r: [[x[r]["step_s"][i] for x in timed] for i in range(sizes["steps"])] for r in step_s},
        "ordered_over_atomic": step_s["ordered"] / step_s["atomic"],
        "exchange_s_median": statistics.median(exchange),
        "exchange_share_of_ordered_step": statistics.median(exchange) / step_s["ordered"],
        "bytes_read_per_step": {r: [x[r]["bytes_read"][-1] for x in timed] for r in step_s},
        "ordered_vs_atomic_params": compare_to_reference(
            [r["ordered"]["params"] for r in timed], _gathered(timed, "atomic"), 2
        ),
        "deterministic_runs": [run[0]["deterministic"] for run in runs],
        "hashes": [[r["ordered"]["hashes"] for r in run] for run in runs],
    }
    out["figures"] = {
        "atomic step s (median)": f"{step_s['atomic']:.4f}",
        "ordered step s (median)": f"{step_s['ordered']:.4f}",
        "ordered / atomic": f"{out['ordered_over_atomic']:.3f}",
        "ordered exchange s (median)": f"{out['exchange_s_median']:.4f}",
    }
    first, second = runs
    out["checks"] = {
        "both reductions ran as asked": out["reductions_run"] == {"atomic": "atomic", "ordered": "ordered"},
        "ordered and atomic parameters equal to rounding after training (max abs < 1e-4)": (
            out["ordered_vs_atomic_params"]["max_abs"] < 1e-4
        ),
        "ordered: the step-boundary exchange was timed and read the peer's contributions": all(x > 0 for x in exchange)
        and all(r["ordered"]["bytes_read"][-1] > r["atomic"]["bytes_read"][-1] for r in timed),
        "two ordered runs (deterministic algorithms, a different rank slowed): bitwise-identical parameters, "
        "SHA-256 of every shard on both ranks": all(
            a["ordered"]["hashes"] == b["ordered"]["hashes"] for a, b in zip(first, second, strict=True)
        ),
        "the ordered runs moved every parameter shard": all(
            r["ordered"]["hashes"][n] != r["ordered"]["initial"][n]
            for run in runs
            for r in run
            for n, shard in r["ordered"]["params"].items()
            if shard.size
        ),
    }
    return out
