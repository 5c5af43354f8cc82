"""Command line of the end-to-end benchmark: ``python -m benchmarks.e2e <workload> [options] [-- script args]``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.e2e import RESULTS_DIR
from benchmarks.e2e.aggregate import aggregate
from benchmarks.e2e.arms import ARMS, QUICK, WORKLOADS, Workload
from benchmarks.e2e.environment import ALLOCATORS
from benchmarks.e2e.report import conditions_text, table_rows, targets_text, text_table, write_outputs
from benchmarks.e2e.runner import run


def parse_args(argv: list[str]) -> tuple[Workload, argparse.Namespace]:
    """The workload and options of ``argv`` (``[workload, *options, "--", *script_args]``); exits on a bad value."""
    usage = f"usage: python -m benchmarks.e2e <{'|'.join(WORKLOADS)}> [options] [-- script args]"
    if argv and argv[0] in ("-h", "--help"):
        print(
            f"{usage}\n\nEnd-to-end benchmark of the examples; `python -m benchmarks.e2e sft --help` lists the options."
        )
        raise SystemExit(0)
    if not argv or argv[0] not in WORKLOADS:
        raise SystemExit(usage)
    workload = WORKLOADS[argv[0]]
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(
        prog=f"python -m benchmarks.e2e {workload.name}",
        description=f"{workload.script} end to end: FSDP2 (random / batch_rebalance / lockstep plan) vs ODC, "
        f"{'4 CPU processes as 2 replicas x 2 shards (HSDP)' if workload.config_files else '2 CPU processes'}, "
        "interleaved repeats. Arguments after `--` go to the script of every arm.",
    )
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every arm (default 3)")
    p.add_argument("--max_steps", type=int, default=workload.max_steps, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=1, help="first steps of each run not measured (default 1)")
    p.add_argument("--batch", type=int, default=workload.batch, help="per_device_train_batch_size of FSDP2 arms")
    p.add_argument("--grad_accum", type=int, default=workload.grad_accum, help="gradient_accumulation_steps")
    p.add_argument("--max_length", type=int, default=workload.max_length, help="truncation; planner token budget")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--arms", default=",".join(workload.arms), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--no_limit", action="store_true", help="skip the measured limit (saves about 2 run times)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"output folder (default: the stored results, benchmarks/e2e/{workload.name}; with --quick "
        f"bench_e2e_{workload.name}_quick)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument(
        "--slow_rank",
        type=int,
        default=None,
        help="slowed-device condition: this rank's compute is made --slow_factor times slower in every arm (after "
        "each microbatch it sleeps (factor - 1) x the microbatch's measured compute); the limit runs at full speed "
        "and gives the ideal for unequal speeds (its tokens/s x sum of the ranks' speeds / ranks)",
    )
    p.add_argument("--slow_factor", type=float, default=1.5, help="how much slower --slow_rank is (default 1.5)")
    p.add_argument(
        "--allocator",
        choices=ALLOCATORS,
        default="caching",
        help="CPU memory allocator of every arm: 'caching' (default; glibc keeps freed blocks for reuse, as the CUDA "
        "caching allocator does) or 'system' (glibc defaults: large blocks are unmapped at free and page-faulted "
        "in again at the next allocation)",
    )
    p.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="DIR",
        help="run nothing: rebuild table, JSON, PNG and snippet in DIR from the runs stored in DIR/results.json",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny run for tests (2 arms, 1 repeat, 2 steps, 64 tokens) unless overridden",
    )
    if "--quick" in argv:  # defaults of the tiny run; options given explicitly still win
        quick = {**QUICK, **workload.quick}
        p.set_defaults(**{k: ",".join(v) if k == "arms" else v for k, v in quick.items()})
    opts = p.parse_args(argv[1:])
    opts.extra = extra
    opts.arms = [a.strip() for a in str(opts.arms).split(",") if a.strip()]
    unknown = [a for a in opts.arms if a not in ARMS]
    if unknown:
        p.error(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    for name in opts.arms:
        if name in workload.unsupported:
            p.error(f"arm {name} cannot run on {workload.name}: {workload.unsupported[name]}")
    if not opts.no_limit and "limit" not in opts.arms:
        opts.arms.append("limit")
    if opts.no_limit and "limit" in opts.arms:
        opts.arms.remove("limit")
    if opts.slow_rank is not None:
        if opts.slow_rank < 1:
            # the limit's processes each run as rank 0: slowing rank 0 would slow the reference the ideal comes from
            p.error(f"--slow_rank must be a rank >= 1 (rank 0 is the limit's rank), got {opts.slow_rank}")
        if not opts.slow_factor >= 1.0:
            p.error(f"--slow_factor must be >= 1, got {opts.slow_factor}")
    if opts.batch < workload.min_batch:
        p.error(
            f"--batch must be at least {workload.min_batch} on {workload.name} ({workload.script} refuses fewer "
            f"examples per microbatch), got {opts.batch}"
        )
    if opts.max_steps <= opts.warmup:
        p.error(f"--max_steps ({opts.max_steps}) must exceed --warmup ({opts.warmup})")
    offline = "--model_name_or_path" not in extra and "--dataset_name" not in extra
    for key, value in workload.replaced.items():
        given = {"max_length": opts.max_length, "per_device_train_batch_size": opts.batch}[key]
        if offline and given == value:
            p.error(
                f"{workload.script} replaces {key}={value} (TRL's default) with its own CPU default on the offline "
                f"data; pick another value (e.g. {value - 1})."
            )
    if opts.out is None:  # a tiny run never replaces the stored results
        opts.out = Path(f"bench_e2e_{workload.name}_quick") if opts.quick else RESULTS_DIR / workload.name
    # absolute: the runs start in the repository root, the harness may not
    opts.out = opts.out.resolve()
    opts.report = opts.report.resolve() if opts.report is not None else None
    return workload, opts


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    workload, opts = parse_args(argv)
    if opts.report is not None:
        result = json.loads((opts.report / "results.json").read_text())
        result.update(aggregate(result["runs"], result["config"]["world_size"], result["config"].get("slow")))
        out = opts.report
    else:
        result, out = run(workload, opts, argv), opts.out
    files = write_outputs(result, out)
    print()
    print(conditions_text(result))
    print()
    print(text_table(table_rows(result)))
    print()
    print("\n".join(targets_text(result)))
    print()
    for kind, path in files.items():
        print(f"{kind:8s} {path}")
    return 0
