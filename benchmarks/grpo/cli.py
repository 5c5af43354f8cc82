"""Command line of the GRPO benchmark: ``python -m benchmarks.grpo [options] [-- script args]``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from benchmarks import REPO
from benchmarks.e2e.environment import ALLOCATORS
from benchmarks.e2e.runner import world_size_of
from benchmarks.grpo import RESULTS_DIR
from benchmarks.grpo.aggregate import aggregate
from benchmarks.grpo.arms import ARMS, CONFIGS, DEFAULT_ARMS, DEFAULTS, REPLACED, RLOO_SCRIPT, SCRIPT, VLLM_ARMS
from benchmarks.grpo.report import conditions_text, ratios_text, table_rows, text_table, write_outputs
from benchmarks.grpo.runner import run

_OWN_OPTIONS = {
    "--max_steps": "--max_steps",
    "--per_device_train_batch_size": "--batch",
    "--gradient_accumulation_steps": "--grad_accum",
    "--num_generations": "--num_generations",
    "--max_completion_length": "--max_completion_length",
    "--seed": "--seed",
    "--output_dir": "--out",
    "--logging_steps": None,
    "--odc_time_collectives": None,
    "--odc": "--arms",
    "--odc_plan": "--arms",
}
"""Script options the harness sets for every run -> the benchmark option to use instead (None: fixed)."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options of ``argv`` (``[*options, "--", *script_args]``); exits with a message on a bad value."""
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.grpo",
        description=f"{SCRIPT} end to end on 2 CPU processes: FSDP2 as TRL runs GRPO (its microbatches, generation "
        "with synced_gpus) against ODC + plan free, on long-tailed completion lengths, in interleaved repeats; with "
        f"--arms rloo_fsdp2,rloo_odc the same two for RLOO ({RLOO_SCRIPT}: the offline RLOO script on the same "
        "completion lengths). Arguments after `--` go to the script of every arm.",
    )
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every arm (default 3)")
    p.add_argument(
        "--max_steps",
        type=int,
        default=DEFAULTS["max_steps"],
        help=f"optimizer steps per run ({DEFAULTS['max_steps']})",
    )
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], help="first steps of each run not measured (1)")
    p.add_argument(
        "--batch", type=int, default=DEFAULTS["batch"], help=f"per_device_train_batch_size ({DEFAULTS['batch']})"
    )
    p.add_argument(
        "--grad_accum",
        type=int,
        default=DEFAULTS["grad_accum"],
        help=f"gradient_accumulation_steps ({DEFAULTS['grad_accum']})",
    )
    p.add_argument("--num_generations", type=int, default=DEFAULTS["num_generations"], help="completions per prompt")
    p.add_argument(
        "--max_completion_length",
        type=int,
        default=DEFAULTS["max_completion_length"],
        help=f"cap of the completions' lengths ({DEFAULTS['max_completion_length']})",
    )
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    p.add_argument(
        "--arms",
        default=",".join(DEFAULT_ARMS),
        help=f"comma-separated, of {', '.join(ARMS)} (default {','.join(DEFAULT_ARMS)}; the vLLM arms need vLLM: run "
        "this benchmark with the interpreter of scripts/vllm_env.sh's environment; the rloo_* arms train with RLOO, "
        "their ratios are over rloo_fsdp2)",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="output folder (default: the stored results, benchmarks/grpo)"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument(
        "--allocator",
        choices=ALLOCATORS,
        default="caching",
        help="CPU memory allocator of every arm (see `python -m benchmarks.e2e sft --help`)",
    )
    p.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="DIR",
        help="run nothing: rebuild table, JSON, PNG and snippet in DIR from the runs stored in DIR/results.json",
    )
    opts = p.parse_args(argv)
    opts.extra = extra
    opts.arms = [a.strip() for a in str(opts.arms).split(",") if a.strip()]
    unknown = [a for a in opts.arms if a not in ARMS]
    if unknown or not opts.arms:
        p.error(f"unknown arm(s) {unknown or opts.arms}; choose from {', '.join(ARMS)}")
    if VLLM_ARMS & set(opts.arms) and importlib.util.find_spec("vllm") is None:
        p.error(
            f"arm(s) {sorted(VLLM_ARMS & set(opts.arms))} generate with vLLM, which this interpreter ({sys.executable}) "
            "lacks: bash scripts/vllm_env.sh builds an environment with it; run the benchmark with its python "
            "(~/.cache/odc_accelerate/vllm-venv/bin/python -m benchmarks.grpo ...)."
        )
    if opts.repeats < 1:
        p.error(f"--repeats must be at least 1, got {opts.repeats}")
    if opts.warmup < 0 or opts.max_steps <= opts.warmup:
        p.error(f"--max_steps ({opts.max_steps}) must exceed --warmup ({opts.warmup}), which must be >= 0")
    for arg in extra:
        key = arg.split("=", 1)[0]
        if key in _OWN_OPTIONS:
            instead = _OWN_OPTIONS[key]
            p.error(
                f"{key} is set by the benchmark for every run"
                + (f"; use the benchmark's {instead} instead" if instead else "")
                + " (arguments after `--` go to the script)."
            )
    offline = "--model_name_or_path" not in extra and "--dataset_name" not in extra
    given = {
        "max_completion_length": opts.max_completion_length,
        "num_generations": opts.num_generations,
        "per_device_train_batch_size": opts.batch,
    }
    for key, value in REPLACED.items():
        if offline and given[key] == value:
            p.error(
                f"{SCRIPT} replaces {key}={value} (TRL's default) with its own CPU default on the offline data; pick "
                f"another value (e.g. {value - 1 if key != 'num_generations' else value // 2})."
            )
    world = world_size_of(REPO / CONFIGS / ARMS["odc"].config)
    if opts.num_generations < 2 or (opts.batch * opts.grad_accum * world) % opts.num_generations:
        p.error(
            f"each optimizer step generates --batch x --grad_accum x {world} ranks = "
            f"{opts.batch * opts.grad_accum * world} completions, which must be whole groups of --num_generations "
            f"({opts.num_generations}, at least 2)."
        )
    # absolute: the runs start in the repository root, the harness may not
    opts.out = (opts.out if opts.out is not None else RESULTS_DIR).resolve()
    opts.report = opts.report.resolve() if opts.report is not None else None
    return opts


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse_args(argv)
    if opts.report is not None:
        result = json.loads((opts.report / "results.json").read_text())
        result.update(aggregate(result["runs"]))
        out = opts.report
    else:
        result, out = run(opts, argv), opts.out
    files = write_outputs(result, out)
    print()
    print(conditions_text(result))
    print()
    print(text_table(table_rows(result)))
    print()
    print("\n".join(ratios_text(result)))
    print()
    for kind, path in files.items():
        print(f"{kind:8s} {path}")
    return 0
