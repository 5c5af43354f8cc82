"""``python -m benchmarks.sim validate`` and ``validate-e2e``: predictions against stored benchmark results.

``validate``: predicts the engine benchmark's 2-rank CPU arms (``python -m benchmarks.engine``) from calibrations that
do not use the predicted figures: compute FLOP/s from the benchmark's no-communication ``limit`` arm (balanced), gloo
collective cost from a live micro-benchmark (`calibrate.measure_gloo`), shared-memory read / accumulate bandwidth and
latency from the transport benchmark's stored results, and one per-group hook overhead fitted on ODC balanced;
predicts FSDP2 balanced / imbalanced, ODC imbalanced and limit imbalanced, and prints % errors.

``validate-e2e``: replays the steps recorded by the end-to-end benchmark (``python -m benchmarks.e2e sft``) and
predicts each FSDP2 / ODC arm's step time (see `benchmarks.sim.replay`).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np

from benchmarks.e2e.environment import CACHING_MALLOC, allocator_env
from benchmarks.sim.calibrate import cpu_hardware, measure_gloo, measure_microbatch_comm
from benchmarks.sim.replay import validate_e2e
from benchmarks.sim.results import load_e2e_result, load_engine_result, load_shm_figures
from benchmarks.sim.scale import planner_cost
from benchmarks.sim.simulator import ModelSpec, simulate


def _shm_text(shm: dict[str, float]) -> str:
    return (
        f"shm read {shm['read_MBps']:.0f} MB/s + {shm['read_us']:.1f} us, accumulate {shm['acc_MBps']:.0f} MB/s + "
        f"{shm['acc_us']:.1f} us, barrier {shm['barrier_us']:.1f} us"
    )


def _engine_cases(cfg: dict) -> tuple[np.ndarray, dict]:
    lengths = np.array([cfg["long"], cfg["short"]])
    return lengths, {"balanced": [[[0], [1]], [[0], [1]]], "imbalanced": [[[0], [1]], [[1], [0]]]}


def run_validate(args: argparse.Namespace) -> dict:
    """Predict the engine benchmark's stored arms (``--engine-json``), print predicted / measured and the errors."""
    measured = load_engine_result(args.engine_json)
    shm = load_shm_figures(args.transport_json)
    cfg = measured["config"]
    model = ModelSpec(
        layers=cfg["layers"], hidden=cfg["dim"], intermediate=4 * cfg["dim"], heads=cfg["heads"], vocab=cfg["vocab"],
        gated_mlp=False, param_bytes=4, grad_bytes=4,
    )  # fmt: skip
    lengths, plans = _engine_cases(cfg)
    _, _, params = model.group_costs()

    # 1. Compute: FLOP/s from the limit arm (balanced: both ranks run [long, short], no communication).
    flop = float((planner_cost(model)(lengths)).sum())
    flops = flop / (measured["limit_balanced_ms"] / 1e3)
    # 2. gloo collectives: live micro-benchmark at this model's group sizes (fp32), fitted to lat + bytes / bw.
    sizes = sorted({int(p * 4) for p in params} | {2**18, 2**23})
    gloo = measure_gloo(sizes, repeats=args.repeats)
    hw = cpu_hardware(flops, gloo, shm, world=2)
    ag_lat, ag_bw = gloo["ag_fit"]
    rs_lat, rs_bw = gloo["rs_fit"]
    # 3. Per-group hook overhead (copy-in / copy-out, ODC's locked adds, fold and publish, spread per group): the
    # one figure fitted on an arm that is also reported, ODC balanced. Solved in closed form: the step is linear in it.
    base = simulate(plans["balanced"], lengths, model, hw, "odc").step_s
    slope = simulate(plans["balanced"], lengths, model, hw.with_(fixed_per_group=1.0), "odc").step_s - base
    fixed = max(0.0, (measured["odc_balanced_ms"] / 1e3 - base) / slope)
    hw = hw.with_(fixed_per_group=fixed)

    rows = []
    for system, key in (("fsdp2", "fsdp"), ("odc", "odc")):
        for workload in ("balanced", "imbalanced"):
            pred = simulate(plans[workload], lengths, model, hw, system)
            rows.append((f"{key}_{workload}", pred.step_s * 1e3, measured[f"{key}_{workload}_ms"]))
    lim = simulate(plans["imbalanced"], lengths, model, hw, "odc").limit_s * 1e3
    rows.append(("limit_imbalanced", lim, measured["limit_imbalanced_ms"]))

    print(f"Validation against the 2-rank CPU engine benchmark (measured: {args.engine_json})")
    print(
        f"calibrated: compute {flops / 1e9:.2f} GFLOP/s from limit_balanced ({measured['limit_balanced_ms']:.1f} ms, "
        f"{flop / 1e9:.2f} GFLOP per rank-step); gloo all-gather {ag_bw / 1e6:.0f} MB/s + {ag_lat * 1e6:.0f} us, "
        f"reduce-scatter {rs_bw / 1e6:.0f} MB/s + {rs_lat * 1e6:.0f} us (live micro-benchmark, sizes {sizes} B; "
        f"simulator uses {hw.intra_bw / 1e6:.0f} MB/s + {hw.intra_lat * 1e6:.0f} us); {_shm_text(shm)} "
        f"({args.transport_json}); hook overhead {fixed * 1e3:.2f} ms per group and pass, fitted on odc_balanced"
    )
    print(f"{'arm':20s} {'predicted ms':>13s} {'measured ms':>12s} {'error %':>8s}")
    out = {}
    for name, pred, meas in rows:
        err = 100 * (pred - meas) / meas
        fitted = " (fitted)" if name == "odc_balanced" else ""
        print(f"{name:20s} {pred:13.1f} {meas:12.1f} {err:8.1f}{fitted}")
        out[name] = {"predicted_ms": round(pred, 1), "measured_ms": meas, "error_pct": round(err, 2)}
    worst = max(abs(v["error_pct"]) for k, v in out.items() if k != "odc_balanced")
    print(f"largest |error| over predicted arms: {worst:.1f}% (target <= 15%)")
    return {"rows": out, "gloo": gloo, "flops": flops, "fixed_per_group_s": fixed, "max_abs_error_pct": worst}


def _use_runs_allocator(result: dict) -> None:
    """Measure communication live under the memory allocator the benchmark's runs used (the spawned measuring
    processes read glibc's variables at start; allocation is a large part of a microbatch's copies on CPU)."""
    for key in CACHING_MALLOC:
        os.environ.pop(key, None)
    os.environ.update(allocator_env(result.get("conditions", {}).get("allocator", "system")))


def run_validate_e2e(args: argparse.Namespace) -> dict:
    """Replay the end-to-end benchmark's stored steps (``--e2e-json``), print predicted / measured per arm."""
    result = load_e2e_result(args.e2e_json)
    shm = load_shm_figures(args.transport_json)
    _use_runs_allocator(result)
    if args.model_config:
        with open(args.model_config) as f:
            config: Any = json.load(f)
    else:
        from odc_accelerate.demo import tiny_qwen2_config

        config = tiny_qwen2_config().to_dict()  # what the examples build offline
    model = ModelSpec.from_config(config, param_bytes=args.param_bytes, grad_bytes=args.param_bytes)
    _, _, params = model.group_costs()
    sizes = sorted({int(p * args.param_bytes) for p in params} | {2**18, 2**23})
    gloo = measure_gloo(sizes, repeats=args.repeats)
    comm = measure_microbatch_comm(config)
    res = validate_e2e(result, model, gloo, shm, comm)
    c = result["config"]
    print(
        f"Validation against the end-to-end benchmark ({args.e2e_json}: {c['workload']}, {c['world_size']} ranks, "
        f"{c['repeats']} repeats, {c['max_steps']} steps of which {c['warmup']} dropped)"
    )
    print(
        f"calibrated: compute {res['flops'] / 1e9:.2f} GFLOP/s from the limit arm; gloo all-gather "
        f"{gloo['ag_fit'][1] / 1e6:.0f} MB/s + {gloo['ag_fit'][0] * 1e6:.0f} us, reduce-scatter "
        f"{gloo['rs_fit'][1] / 1e6:.0f} MB/s + {gloo['rs_fit'][0] * 1e6:.0f} us (live, sizes {sizes} B); "
        f"{_shm_text(shm)} ({args.transport_json}); one microbatch's communication, measured live: FSDP2 "
        f"{comm['fsdp2_comm'] * 1e3:.1f} ms, ODC {comm['odc_comm'] * 1e3:.1f} ms (-> per group and pass "
        f"{res['fixed_per_group_s']['fsdp2'] * 1e3:.2f} / {res['fixed_per_group_s']['odc'] * 1e3:.2f} ms beyond the "
        "bandwidth figures); nothing fitted on the predicted arms"
    )
    print(
        f"{'arm':18s} {'pred step s':>11s} {'meas step s':>11s} {'error %':>8s} {'pred tok/s':>10s} {'meas tok/s':>10s}"
    )
    for name, r in res["rows"].items():
        print(
            f"{name:18s} {r['predicted_s']:11.3f} {r['measured_s']:11.3f} {r['error_pct']:8.1f} "
            f"{r['predicted_tokens_per_s']:10.1f} {r['measured_tokens_per_s']:10.1f}"
        )
    for name, v in res["speedups"].items():
        print(f"{name:28s} predicted {v['predicted']:.3f}x  measured {v['measured']:.3f}x")
    print(f"largest |error| over predicted arms: {res['max_abs_error_pct']:.1f}% (target <= 15%)")
    res["gloo"], res["comm"] = gloo, comm
    return res
