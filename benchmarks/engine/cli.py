"""Command line of the engine benchmark: runs the workers, prints the table and JSON, stores the results."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.engine import RESULTS_DIR
from benchmarks.engine.workers import ARMS, WORKLOADS, memory_worker, timing_worker


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine", description="ODC vs FSDP2 step time and memory on 2 CPU ranks."
    )
    p.add_argument("--steps", type=int, default=8, help="measured steps per arm and workload")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--long", type=int, default=1024, help="tokens of the long sequence")
    p.add_argument("--short", type=int, default=256, help="tokens of the short sequence (4:1 by default)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (for tests)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for results.json and table.txt (default: the stored results, benchmarks/engine; with --quick: "
        "none, nothing is written)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.layers, args.dim, args.long, args.short = 2, 1, 2, 64, 64, 16
        args.vocab = 256
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    from odc_accelerate.testing import launch

    cfg = dict(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers, mlp_ratio=4)
    opts = dict(warmup=args.warmup, steps=args.steps, long=args.long, short=args.short)
    results = launch(timing_worker, 2, cfg, opts, timeout=3600, threads=1)
    # Each step ends with a barrier, so both ranks time the same step; take the slower rank's view.
    samples = {
        a: {
            w: [max(t) for t in zip(results[0]["times"][a][w], results[1]["times"][a][w], strict=True)]
            for w in WORKLOADS
        }
        for a in ARMS
    }
    # spawn: each peak RSS from a fresh interpreter, as stored results were measured (a fork carries its server's)
    rss = {
        a: max(launch(memory_worker, 2, a, cfg, opts, timeout=1800, threads=1, start_method="spawn"))
        for a in ("fsdp", "fsdp_keep", "odc", "odc_both")
    }
    med = {a: {w: statistics.median(samples[a][w]) * 1e3 for w in WORKLOADS} for a in ARMS}
    odc_waits = [x for r in results for x in r["waits"]["odc"]["imbalanced"]]
    summary = {
        "fsdp_balanced_ms": med["fsdp"]["balanced"],
        "fsdp_imbalanced_ms": med["fsdp"]["imbalanced"],
        "odc_balanced_ms": med["odc"]["balanced"],
        "odc_imbalanced_ms": med["odc"]["imbalanced"],
        "odc_layersync_balanced_ms": med["odc_layersync"]["balanced"],
        "odc_layersync_imbalanced_ms": med["odc_layersync"]["imbalanced"],
        "limit_balanced_ms": med["limit"]["balanced"],
        "limit_imbalanced_ms": med["limit"]["imbalanced"],
        "fsdp_keep_balanced_ms": med["fsdp_keep"]["balanced"],
        "fsdp_keep_imbalanced_ms": med["fsdp_keep"]["imbalanced"],
        "odc_both_balanced_ms": med["odc_both"]["balanced"],
        "odc_both_imbalanced_ms": med["odc_both"]["imbalanced"],
        "fsdp_peak_rss_mb": rss["fsdp"],
        "odc_peak_rss_mb": rss["odc"],
        "fsdp_keep_peak_rss_mb": rss["fsdp_keep"],
        "odc_both_peak_rss_mb": rss["odc_both"],
        "odc_wait_imbalanced_ms": statistics.median(odc_waits) * 1e3,
    }
    summary["ratio_odc_imbalanced_over_balanced"] = summary["odc_imbalanced_ms"] / summary["odc_balanced_ms"]
    summary["ratio_fsdp_over_odc_imbalanced"] = summary["fsdp_imbalanced_ms"] / summary["odc_imbalanced_ms"]
    summary["ratio_odc_over_fsdp_balanced"] = summary["odc_balanced_ms"] / summary["fsdp_balanced_ms"]
    summary["ratio_odc_over_fsdp_rss"] = summary["odc_peak_rss_mb"] / summary["fsdp_peak_rss_mb"]
    summary["ratio_odc_both_over_fsdp_balanced"] = summary["odc_both_balanced_ms"] / summary["fsdp_balanced_ms"]
    summary["ratio_odc_both_over_fsdp_keep_balanced"] = (
        summary["odc_both_balanced_ms"] / summary["fsdp_keep_balanced_ms"]
    )
    summary["ratio_odc_both_over_limit_balanced"] = summary["odc_both_balanced_ms"] / summary["limit_balanced_ms"]
    summary["config"] = dict(cfg, **opts, samples_per_cell=len(samples["odc"]["balanced"]))
    return summary


def _table(s: dict[str, Any]) -> str:
    rows = [
        ("arm", "balanced ms", "imbalanced ms", "imb/bal", "peak RSS MB"),
        ("FSDP2 (gloo)", s["fsdp_balanced_ms"], s["fsdp_imbalanced_ms"], None, s["fsdp_peak_rss_mb"]),
        (
            "FSDP2 keep params+grads",
            s["fsdp_keep_balanced_ms"],
            s["fsdp_keep_imbalanced_ms"],
            None,
            s["fsdp_keep_peak_rss_mb"],
        ),
        ("ODC", s["odc_balanced_ms"], s["odc_imbalanced_ms"], None, s["odc_peak_rss_mb"]),
        (
            "ODC memory policy both",
            s["odc_both_balanced_ms"],
            s["odc_both_imbalanced_ms"],
            None,
            s["odc_both_peak_rss_mb"],
        ),
        ("ODC + per-layer barrier", s["odc_layersync_balanced_ms"], s["odc_layersync_imbalanced_ms"], None, None),
        ("limit (no comm)", s["limit_balanced_ms"], s["limit_imbalanced_ms"], None, None),
    ]
    lines = []
    for i, (name, bal, imb, _, mem) in enumerate(rows):
        if i == 0:
            lines.append(f"{name:<26}{bal:>13}{imb:>15}{'imb/bal':>9}{mem:>13}")
            continue
        mem_text = f"{mem:13.0f}" if mem is not None else f"{'-':>13}"
        lines.append(f"{name:<26}{bal:13.1f}{imb:15.1f}{imb / bal:9.2f}{mem_text}")
    lines += [
        "",
        f"ODC imbalanced / ODC balanced        {s['ratio_odc_imbalanced_over_balanced']:.3f}  (target <= 1.05)",
        f"FSDP2 imbalanced / ODC imbalanced    {s['ratio_fsdp_over_odc_imbalanced']:.3f}  (target >= 1.8)",
        f"ODC balanced / FSDP2 balanced        {s['ratio_odc_over_fsdp_balanced']:.3f}  (target <= 0.85)",
        f"ODC peak RSS / FSDP2 peak RSS        {s['ratio_odc_over_fsdp_rss']:.3f}  (target <= 1.15)",
        f"ODC both balanced / FSDP2 balanced   {s['ratio_odc_both_over_fsdp_balanced']:.3f}  (target <= 0.7)",
        f"ODC both / FSDP2 keep, balanced      {s['ratio_odc_both_over_fsdp_keep_balanced']:.3f}  (like for like)",
        f"ODC both / limit, balanced           {s['ratio_odc_both_over_limit_balanced']:.3f}  (1 = no comm cost)",
        f"ODC barrier wait per imbalanced step {s['odc_wait_imbalanced_ms']:.1f} ms",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    summary = run(args)
    c = summary["config"]
    title = (
        f"ODC engine benchmark: 2 CPU ranks x 1 thread, {c['layers']} blocks, dim {c['dim']}, "
        f"microbatches long={c['long']} short={c['short']} tokens, arms interleaved step by step, "
        f"{c['samples_per_cell']} measured steps per cell (medians)"
    )
    table = _table(summary)
    print(title)
    print(table)
    out = args.out if args.out is not None or args.quick else RESULTS_DIR
    if out is not None:  # before the JSON line, which stays the last line of the output
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
        (out / "table.txt").write_text(title + "\n" + table + "\n")
        print(f"wrote {out / 'results.json'}, {out / 'table.txt'}")
    print(json.dumps(summary))
    return 0
