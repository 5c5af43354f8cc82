"""Where a balanced step's time goes, per arm: ``python -m benchmarks.engine.profile [--steps N] [--out DIR]``.

The engine benchmark's model and balanced workload; the arms (default ``odc``, ``odc_both``, ``limit``) interleaved
step by step in one pair of processes, each step under ``torch.profiler``. Per arm and rank: the median step time
(profiled, so a little slower than the benchmark's), each op's self CPU time per step (the mean over the profiled
steps), and for ODC arms the engine's own phases (`StepStats`: time in the gather and scatter-accumulate hooks, the
fold, the publish and the step's barrier). The ops that differ between arms say where ODC's time above the
no-communication limit goes; the engine's phases say how much of it is ODC's own data path.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.engine.workers import ARMS, ENGINE_PHASES, EXTRA_ARMS, profile_worker

DEFAULT_ARMS = ("odc", "odc_both", "limit")


def run(arms: list[str], steps: int, quick: bool = False) -> list[dict[str, Any]]:
    from odc_accelerate.testing import launch

    cfg = dict(vocab=2048, dim=256, heads=4, layers=8, mlp_ratio=4)
    opts = dict(warmup=2, long=1024, short=256)
    if quick:
        cfg.update(vocab=256, dim=64, layers=2)
        opts.update(warmup=1, long=64, short=16)
    results = launch(profile_worker, 2, arms, cfg, opts, steps, timeout=3600, threads=1)
    return [dict(r, rank=rank, config=dict(cfg, **opts, steps=steps)) for rank, r in enumerate(results)]


def table(result: dict[str, Any], rows: int = 25) -> str:
    """One rank's ops side by side (ms per step, the largest first), then the totals and the engine's phases."""
    arms = list(result["wall_ms"])
    ops = result["ops_ms"]
    keys = sorted(set().union(*ops.values()), key=lambda k: -max(ops[a].get(k, 0.0) for a in arms))
    lines = [
        f"rank {result['rank']}: self CPU ms per balanced step",
        f"{'op':<58}" + "".join(f"{a:>11}" for a in arms),
    ]
    lines += [f"{k[:57]:<58}" + "".join(f"{ops[a].get(k, 0.0):11.1f}" for a in arms) for k in keys[:rows]]
    lines.append(f"{'all ops':<58}" + "".join(f"{sum(ops[a].values()):11.1f}" for a in arms))
    lines.append(f"{'step (wall, median)':<58}" + "".join(f"{result['wall_ms'][a]:11.1f}" for a in arms))
    for phase in ENGINE_PHASES:
        values = [f"{result['phases_ms'][a][phase]:11.1f}" if a in result["phases_ms"] else f"{'-':>11}" for a in arms]
        lines.append(f"{'engine ' + phase.removesuffix('_s') + ' (median)':<58}" + "".join(values))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine.profile", description=__doc__.split("\n\n")[0])
    choices = ARMS + EXTRA_ARMS
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, of {', '.join(choices)}")
    p.add_argument("--steps", type=int, default=6, help="profiled balanced steps per arm (default 6)")
    p.add_argument("--quick", action="store_true", help="a tiny model (for tests)")
    p.add_argument("--out", type=Path, default=None, help="folder for profile.json and profile.txt")
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    unknown = sorted(set(arms) - set(choices))
    if unknown or args.steps < 1:
        p.error(f"unknown arms {unknown} (choose from {', '.join(choices)})" if unknown else "--steps must be >= 1")
    results = run(arms, args.steps, quick=args.quick)
    text = "\n\n".join(table(r) for r in results)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "profile.txt").write_text(text + "\n")
        print(f"wrote {args.out / 'profile.json'}, {args.out / 'profile.txt'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
