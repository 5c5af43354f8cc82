"""``python -m benchmarks.sim validate-e2e``: the simulator against the end-to-end benchmark's measured steps.

``python -m benchmarks.e2e sft`` records, per run and rank, every optimizer step's microbatch shapes
(`odc_accelerate.telemetry.StepTrace`). This module replays those steps through `simulate` and compares the predicted
step times with the measured ones, arm by arm.

What is calibrated, and from what (never from the FSDP2 or ODC arms that are predicted):

- compute: effective FLOP/s of the benchmark's own ``limit`` arm (the same example, one process per rank's worth of
  work, no communication): its measured steps' FLOPs over their measured time. The optimizer step, data collation
  and the Trainer's per-step bookkeeping are folded into this one figure (they scale with the work of the step);
- communication per microbatch: FSDP2's from gloo ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
  ``latency + bytes / bandwidth`` (`calibrate.measure_gloo`, live, at the model's param-group sizes), ODC's from the
  transport benchmark's stored shared-memory read / accumulate figures (`results.load_shm_figures`); then, per system, one overhead per param group and pass
  (``Hardware.fixed_per_group``) set so that one microbatch's communication equals what
  `calibrate.measure_microbatch_comm` measures live on the same model (a few tokens, sharded vs unsharded: copies,
  allocation and hook costs the bare bandwidth figures miss). No overlap, since the benchmark times FSDP2's
  collectives synchronously (`odc_accelerate.telemetry.CollectiveTimer`). Gradients are reduced in each rank's last
  microbatch only (``accumulate_locally``: the Trainer's ``no_sync``, which every arm runs with).

Compute of a microbatch is charged on its padded shape (``rows x width``: the model runs on the padding too), the
attention term per row (or per packed sequence for padding-free batches).
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from benchmarks.sim.calibrate import cpu_hardware
from benchmarks.sim.simulator import Hardware, ModelSpec, simulate

Plan = list[list[list[int]]]


def step_plans(trace: list[list[dict]], warmup: int) -> list[tuple[Plan, np.ndarray, float, int]]:
    """``[(plan, lengths, measured step_s, real tokens)]`` of the measured steps of one process's trace (``trace[rank][step]``).

    Every padded row (or packed sequence) is one "sample" of ``lengths`` (its width); ``plan[r][k]`` lists the rows of
    microbatch ``k`` of rank ``r``. The measured step time is the slowest rank's (they end the step together).
    """
    if not trace or not trace[0]:
        raise ValueError("empty trace: the run was made without ODC_TRACE_DIR (rerun `python -m benchmarks.e2e`)")
    steps = min(len(t) for t in trace)
    out = []
    for s in range(warmup, steps):
        lengths: list[int] = []
        plan: Plan = []
        real = 0
        for rank in trace:
            mbs = []
            for shape in rank[s]["microbatches"]:
                rows = shape.get("segments") or [shape["width"]] * shape["rows"]
                mbs.append(list(range(len(lengths), len(lengths) + len(rows))))
                lengths.extend(rows)
                real += sum(shape["row_tokens"])
            plan.append(mbs)
        out.append((plan, np.asarray(lengths, dtype=np.float64), max(rank[s]["step_s"] for rank in trace), real))
    return out


def _flops(plan: Plan, lengths: np.ndarray, model: ModelSpec) -> float:
    unit = Hardware(flops=1.0, gpus_per_node=1, intra_bw=1.0, inter_bw=1.0)
    return float(simulate(plan, lengths, model, unit, "odc").busy_s.sum())  # FLOPs of every rank


def calibrate_flops(limit_runs: list[dict], model: ModelSpec, warmup: int) -> float:
    """Effective FLOP/s from the ``limit`` arm: each of its processes ran a whole global step (W ranks' work)."""
    flop, seconds = 0.0, 0.0
    for run in limit_runs:
        for trace in run["trace"]:
            for plan, lengths, step_s, _ in step_plans(trace, warmup):
                flop += _flops(plan, lengths, model)
                seconds += step_s
    if seconds <= 0:
        raise ValueError("the limit arm has no measured step to calibrate compute on")
    return flop / seconds


def fit_fixed_per_group(model: ModelSpec, hw: Hardware, world: int, system: str, comm_s: float) -> float:
    """The per-group, per-pass overhead that makes one empty microbatch's communication equal ``comm_s``."""
    plan: Plan = [[[r]] for r in range(world)]
    zero = np.zeros(world)
    bare = hw.with_(barrier_lat=0.0, fixed_per_group=0.0)
    base = simulate(plan, zero, model, bare, system).step_s
    slope = simulate(plan, zero, model, bare.with_(fixed_per_group=1.0), system).step_s - base
    return (comm_s - base) / slope


def predict_arm(runs: list[dict], model: ModelSpec, hw: Hardware, system: str, warmup: int) -> dict[str, Any]:
    """Predicted and measured mean step time and real tokens/s of an arm (medians over its repeats)."""
    pred, meas, tokens = [], [], []
    for run in runs:
        steps = step_plans(run["trace"][0], warmup)
        # The Trainer (and this package's balanced loop) keep gradients local until a rank's last microbatch.
        pred.append(
            statistics.fmean(
                simulate(p, ln, model, hw, system, accumulate_locally=True).step_s for p, ln, _, _ in steps
            )
        )
        meas.append(statistics.fmean(t for _, _, t, _ in steps))
        tokens.append(statistics.fmean(n for *_, n in steps))
    p, m, n = statistics.median(pred), statistics.median(meas), statistics.median(tokens)
    return {
        "predicted_s": p, "measured_s": m, "error_pct": 100.0 * (p - m) / m, "runs": len(runs),
        "predicted_tokens_per_s": n / p, "measured_tokens_per_s": n / m,
    }  # fmt: skip


SYSTEMS = {
    "fsdp2_random": "fsdp2",
    "fsdp2_rebalance": "fsdp2",
    "fsdp2_lockstep": "fsdp2",
    "odc": "odc",
    # what the replay models for ODC: gradients kept until each rank's last microbatch (--odc_memory_policy grads)
    "odc_grads": "odc",
}


def validate_e2e(result: dict, model: ModelSpec, gloo: dict, shm: dict, comm: dict) -> dict[str, Any]:
    """Predict every FSDP2 / ODC arm of an end-to-end benchmark result (``results.json``).

    Args:
        result (`dict`): ``results.json`` of ``python -m benchmarks.e2e sft`` (with step traces).
        model (`ModelSpec`): the benchmarked model.
        gloo (`dict`): `calibrate.measure_gloo`'s result at the model's group sizes.
        shm (`dict`): shared-memory figures (``read_MBps``, ``acc_MBps``, ``read_us``, ``acc_us``, ``barrier_us``).
        comm (`dict`): `calibrate.measure_microbatch_comm`'s result (``fsdp2_comm``, ``odc_comm`` seconds).
    """
    cfg = result["config"]
    if cfg.get("workload", "sft") != "sft":
        raise ValueError(
            f"validate-e2e replays SFT steps (policy forward + backward); the {cfg['workload']!r} benchmark's steps "
            "also run reference-model forwards, which the simulator does not model. Pass an SFT result."
        )
    runs = result["runs"]
    world, warmup = int(cfg["world_size"]), int(cfg["warmup"])
    if "limit" not in runs:
        raise ValueError("the benchmark was run with --no_limit: the limit arm calibrates compute; rerun without it")
    flops = calibrate_flops(runs["limit"], model, warmup)
    hw = cpu_hardware(flops, gloo, shm, world)
    hws = {
        system: hw.with_(fixed_per_group=fit_fixed_per_group(model, hw, world, system, comm[f"{system}_comm"]))
        for system in ("fsdp2", "odc")
    }
    rows = {
        name: predict_arm(runs[name], model, hws[system], system, warmup)
        for name, system in SYSTEMS.items()
        if name in runs
    }
    speedups = {}
    for name in (n for n, system in SYSTEMS.items() if system == "odc" and n in rows):
        for base in ("fsdp2_random", "fsdp2_rebalance", "fsdp2_lockstep"):
            if base in rows:
                # arms see different samples in a step: compare tokens/s, not step times
                odc, other = rows[name], rows[base]
                speedups[f"{name}_vs_{base}"] = {
                    "predicted": odc["predicted_tokens_per_s"] / other["predicted_tokens_per_s"],
                    "measured": odc["measured_tokens_per_s"] / other["measured_tokens_per_s"],
                }
    worst = max(abs(r["error_pct"]) for r in rows.values())
    return {
        "flops": flops,
        "fixed_per_group_s": {k: v.fixed_per_group for k, v in hws.items()},
        "rows": rows,
        "speedups": speedups,
        "max_abs_error_pct": worst,
    }
