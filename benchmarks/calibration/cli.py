"""``python -m benchmarks.calibration --device cuda --out DIR``: time real model shapes, fit, write the results.

Each (model, attention kernel) pair runs in a fresh process (`benchmarks.calibration.measure`) under its share of
``--budget-s``; this process only schedules, fits and writes, so it never imports torch.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.calibration.configs import DEFAULT_LENGTHS, DEFAULT_MODELS, MODEL_CONFIGS
from benchmarks.calibration.fit import QuadraticFit, describe_fit, fit_quadratic, fit_scaled
from benchmarks.calibration.load import FORMAT
from odc_accelerate.planning import cost_from_config

ATTN_KINDS = ("sdpa", "flash_attention_2", "eager")
# Time a process may take beyond its share of the budget before it is killed: interpreter start, imports, CUDA
# context, building the model (the per-length loop itself keeps to the share).
GRACE_S = 60.0


def _csv(kind, what: str):
    def parse(text: str) -> list:
        try:
            values = [kind(v.strip()) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: a comma-separated list, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{what}: at least one value")
        return values

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.calibration",
        description="Time forward + backward of one sequence per length for real model shapes (random weights, "
        "bf16), fit time = c + a L + b L^2, and write calibration.json and summary.txt for the simulator.",
    )
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (a dry run)")
    p.add_argument("--out", type=Path, required=True, help="folder for calibration.json and summary.txt")
    p.add_argument(
        "--models",
        type=_csv(str, "--models"),
        default=list(DEFAULT_MODELS),
        help=f"comma-separated, of {', '.join(MODEL_CONFIGS)} (default: {','.join(DEFAULT_MODELS)})",
    )
    p.add_argument(
        "--lengths",
        type=_csv(int, "--lengths"),
        default=list(DEFAULT_LENGTHS),
        help="comma-separated sequence lengths; a model stops at its first out-of-memory length "
        f"(default: {','.join(map(str, DEFAULT_LENGTHS))})",
    )
    p.add_argument(
        "--attn",
        type=_csv(str, "--attn"),
        default=["auto"],
        help="attention kernels, comma-separated, of sdpa, flash_attention_2, eager; auto (default): sdpa, plus "
        "flash_attention_2 when the flash_attn package is installed",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per length (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per length, at most (default 5)")
    p.add_argument("--min-repeats", type=int, default=3, help="fewer than this and a length is skipped (default 3)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=360.0,
        help="seconds for the whole run, shared by the models; trims repeats, then the longest lengths (default "
        f"360; each model's process may take up to {GRACE_S:.0f} s more to start and build its model)",
    )
    p.add_argument(
        "--no-gradient-checkpointing",
        action="store_true",
        help="time without activation checkpointing (default: with it, as TRL's SFTConfig defaults)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads in each process (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    unknown = [m for m in args.models if m not in MODEL_CONFIGS]
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {', '.join(MODEL_CONFIGS)}")
    if len(set(args.models)) != len(args.models):
        p.error(f"--models: listed twice in {args.models}")
    lengths = sorted(set(args.lengths))
    if lengths[0] < 1:
        p.error(f"--lengths must be positive, got {args.lengths}")
    if len(lengths) < 3:
        p.error(f"--lengths: the fit has 3 coefficients and needs at least 3 distinct lengths, got {lengths}")
    for m in args.models:
        limit = MODEL_CONFIGS[m]["max_position_embeddings"]
        if lengths[-1] > limit:
            p.error(f"--lengths: {lengths[-1]} is beyond {m}'s max_position_embeddings ({limit})")
    if args.warmup < 0 or args.min_repeats < 1 or args.repeats < args.min_repeats:
        p.error("--warmup must be >= 0 and 1 <= --min-repeats <= --repeats")
    if args.budget_s <= 0:
        p.error(f"--budget-s must be positive, got {args.budget_s}")
    has_flash = importlib.util.find_spec("flash_attn") is not None
    attn: list[str] = []
    for kind in args.attn:
        if kind == "auto":
            attn += ["sdpa"] + (["flash_attention_2"] if has_flash else [])
        elif kind not in ATTN_KINDS:
            p.error(f"--attn: unknown {kind!r}; choose from auto, {', '.join(ATTN_KINDS)}")
        elif kind == "flash_attention_2" and not has_flash:
            p.error("--attn flash_attention_2 needs the flash_attn package, which is not installed here")
        else:
            attn.append(kind)
    args.lengths = lengths
    return list(dict.fromkeys(attn))


def _run_jobs(args: argparse.Namespace, attn: list[str], workdir: Path) -> list[dict[str, Any]]:
    """Run one process per (model, kernel), each under an equal share of what is left of the budget."""
    jobs = [(m, a) for m in args.models for a in attn]
    t_end = time.time() + args.budget_s
    entries = []
    for i, (model, kind) in enumerate(jobs):
        share = max(0.0, t_end - time.time()) / (len(jobs) - i)
        job = {
            "model": model,
            "attn_implementation": kind,
            "config": MODEL_CONFIGS[model],
            "device": args.device,
            "dtype": args.dtype,
            "lengths": args.lengths,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "min_repeats": args.min_repeats,
            "gradient_checkpointing": not args.no_gradient_checkpointing,
            "seed": args.seed,
            "threads": args.threads,
            "deadline_unix": time.time() + share,
        }
        job_path, result_path = workdir / f"job{i}.json", workdir / f"result{i}.json"
        job_path.write_text(json.dumps(job))
        print(f"[calibration] {model} ({kind}): {share:.0f} s of the budget, in a fresh process", flush=True)
        cmd = [sys.executable, "-m", "benchmarks.calibration.measure", str(job_path), str(result_path)]
        error = None
        try:
            proc = subprocess.run(cmd, timeout=share + GRACE_S, stderr=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
                error = f"measuring process exited with {proc.returncode}: {tail[0]}"
                sys.stderr.write(proc.stderr)
        except subprocess.TimeoutExpired:
            error = f"measuring process killed after {share + GRACE_S:.0f} s"
        entry: dict[str, Any] = {"model": model, "attn_implementation": kind, "points": [], "stopped": None}
        if result_path.is_file():
            entry.update(json.loads(result_path.read_text()))
        if error:
            entry["error"] = error
            print(f"[calibration] {model} ({kind}): {error}", flush=True)
        entry["config"] = MODEL_CONFIGS[model]
        entries.append(entry)
    return entries


def _add_fit(entry: dict[str, Any]) -> QuadraticFit | None:
    points = entry["points"]
    if len(points) < 3:
        entry["fit"] = None
        return None
    try:
        fit = fit_quadratic([p["length"] for p in points], [p["median_s"] for p in points])
    except ValueError as exc:  # times that do not grow with L: keep the file and its raw points, say why
        entry["fit"], entry["fit_error"] = None, str(exc)
        return None
    flops = cost_from_config(entry["config"])
    entry["fit"] = {
        "formula": "median_s = intercept_s + linear_s_per_token * L + quadratic_s_per_token2 * L^2",
        "method": "least squares on relative residuals, coefficients >= 0",
        "intercept_s": fit.intercept_s,
        "linear_s_per_token": fit.linear_s,
        "quadratic_s_per_token2": fit.quadratic_s,
        "rel_errors": list(fit.rel_errors),
        "max_rel_error": fit.max_rel_error,
        # How the FLOP model the simulator otherwise uses compares (no recompute counted in the FLOPs).
        "flops_linear_per_token": flops.linear,
        "flops_quadratic_per_token2": flops.quadratic,
        "effective_tflops_linear": flops.linear / fit.linear_s / 1e12 if fit.linear_s > 0 else None,
        "effective_tflops_quadratic": flops.quadratic / fit.quadratic_s / 1e12 if fit.quadratic_s > 0 else None,
    }
    entry["fit"].update(planner_check(entry))
    return fit


def planner_check(entry: dict[str, Any]) -> dict[str, Any]:
    """How well the planner's own cost model (``cost="auto"`` from the model's config) predicts the measured times, up
    to its unit: ``median_s ~ c + k cost(L)``. For a model with layers of other kinds than full attention (hybrid,
    sliding-window), the same with the ``L^2`` term charged on every layer, as a cost model that ignores
    ``layer_types`` would."""
    lengths = [p["length"] for p in entry["points"]]
    seconds = [p["median_s"] for p in entry["points"]]
    out = {
        "planner_cost_max_rel_error": max(
            abs(e) for e in fit_scaled(lengths, seconds, cost_from_config(entry["config"]))[2]
        )
    }
    kinds = entry["config"].get("layer_types")
    if kinds and any(kind != "full_attention" for kind in kinds):
        every = {**entry["config"], "layer_types": ["full_attention"] * len(kinds)}
        every.pop("sliding_window", None)
        errors = fit_scaled(lengths, seconds, cost_from_config(every))[2]
        out["planner_cost_every_layer_max_rel_error"] = max(abs(e) for e in errors)
    return out


def _summary(data: dict[str, Any], fits: list[QuadraticFit | None]) -> str:
    s = data["settings"]
    lines = [
        f"Calibration, {data['created']}: {data['device'].get('name')} ({data['device'].get('type')}), "
        + ", ".join(f"{k} {v}" for k, v in data["versions"].items() if v),
        f"forward + backward of one sequence (batch 1, causal LM loss over all tokens), {s['dtype']}, activation "
        f"checkpointing {'on' if s['gradient_checkpointing'] else 'off'}; median of up to {s['repeats']} repeats "
        f"after {s['warmup']} warm-ups; budget {s['budget_s']:.0f} s, took {data['elapsed_s']:.0f} s",
        "",
    ]
    for entry, fit in zip(data["models"], fits, strict=True):
        lines.append(f"{entry['model']} ({entry['attn_implementation']}), {entry.get('num_parameters', 0) / 1e6:.1f}M")
        lines.append(f"  {'length':>7s} {'median ms':>10s} {'fit ms':>10s} {'error':>8s} {'peak GiB':>9s}")
        pred = fit.predict([p["length"] for p in entry["points"]]) if fit else [None] * len(entry["points"])
        for p, f in zip(entry["points"], pred, strict=True):
            mem = f"{p['peak_memory_bytes'] / 2**30:9.2f}" if p.get("peak_memory_bytes") else f"{'-':>9s}"
            fit_ms = f"{f * 1e3:10.2f} {(f - p['median_s']) / p['median_s']:+8.2%}" if fit else f"{'-':>10s} {'-':>8s}"
            lines.append(f"  {p['length']:7d} {p['median_s'] * 1e3:10.2f} {fit_ms} {mem}")
        if fit:
            lines.append(f"  {describe_fit(fit)}")
            rates = [
                f"{part} part at {entry['fit'][f'effective_tflops_{part}']:.3g}"
                for part in ("linear", "quadratic")
                if entry["fit"][f"effective_tflops_{part}"]
            ]
            if rates:
                lines.append(
                    f"  {' and '.join(rates)} TFLOP/s of the planner's FLOP count (flops_cost, which counts no "
                    "activation recompute)"
                )
            check = (
                '  the planner\'s cost model (cost="auto" from the config), time = c + k cost(L): max relative error '
            )
            check += f"{entry['fit']['planner_cost_max_rel_error']:.2%}"
            if "planner_cost_every_layer_max_rel_error" in entry["fit"]:
                check += (
                    f" (with the L^2 term on every layer, ignoring layer_types: "
                    f"{entry['fit']['planner_cost_every_layer_max_rel_error']:.2%})"
                )
            lines.append(check)
        elif not entry.get("fit_error"):
            lines.append("  no fit: fewer than 3 lengths measured")
        for key in ("stopped", "error", "fit_error"):
            if entry.get(key):
                lines.append(f"  {key}: {entry[key]}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    attn = _check_args(p, args)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="calibration-") as tmp:
        entries = _run_jobs(args, attn, Path(tmp))
    fits = [_add_fit(e) for e in entries]
    measured = next((e for e in entries if "device" in e), {})
    data = {
        "format": FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.calibration " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": measured.get("device", {"type": args.device}),
        "versions": measured.get("versions", {}),
        "settings": {
            "dtype": args.dtype,
            "gradient_checkpointing": not args.no_gradient_checkpointing,
            "batch_size": 1,
            "loss": "causal LM loss over all tokens (labels = input_ids)",
            "lengths": args.lengths,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "min_repeats": args.min_repeats,
            "budget_s": args.budget_s,
            "seed": args.seed,
        },
        "elapsed_s": time.time() - t0,
        "models": [{k: v for k, v in e.items() if k not in ("device", "versions")} for e in entries],
    }
    out_json = args.out / "calibration.json"
    tmp_json = out_json.with_suffix(".json.tmp")
    tmp_json.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp_json, out_json)
    summary = _summary(data, fits)
    (args.out / "summary.txt").write_text(summary)
    print(summary)
    print(f"wrote {out_json} and {args.out / 'summary.txt'}")
    if not any(fits):
        print("[calibration] error: no model has a fit (see the errors above)", file=sys.stderr)
        return 1
    return 0
