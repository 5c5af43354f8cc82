"""Launching the GRPO benchmark's runs: every arm, interleaved repeats in alternating order, what each run recorded.

Processes are started, timed, killed on a timeout or Ctrl-C and trimmed by the end-to-end benchmark's runner
(`benchmarks.e2e.runner`), in the same environment (`benchmarks.e2e.environment`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks import REPO
from benchmarks.e2e.records import read_rss
from benchmarks.e2e.runner import RUN_EXAMPLE, _run_processes, _trim, run_conditions, world_size_of
from benchmarks.grpo.aggregate import aggregate
from benchmarks.grpo.arms import ARMS, CONFIGS, SCRIPT, VLLM_ARMS, VLLM_ENV, Arm, configs_of, script_of
from benchmarks.grpo.records import make_record, parse_log_history


def script_args(arm: Arm, opts: argparse.Namespace, output_dir: Path) -> list[str]:
    """Arguments of the example for one arm: same sizes, prompts and seed for both, then the arm's own options."""
    args = [
        "--max_steps", str(opts.max_steps),
        "--logging_steps", "1",
        "--save_strategy", "no",
        "--report_to", "none",
        "--per_device_train_batch_size", str(opts.batch),
        "--gradient_accumulation_steps", str(opts.grad_accum),
        "--num_generations", str(opts.num_generations),
        "--max_completion_length", str(opts.max_completion_length),
        "--seed", str(opts.seed),
        "--output_dir", str(output_dir),
        # Wall times: generation is logged as wall time inside generate, so busy must be too (timing FSDP2's
        # collectives would take their waits out of busy, not out of generation); FSDP2 also runs faster untimed.
        "--odc_time_collectives", "false",
        *arm.args,
    ]  # fmt: skip
    return args + list(opts.extra)


def command(arm: Arm, opts: argparse.Namespace, run_dir: Path) -> dict:
    """The process of one run, ``{"cmd", "out", "rss"}``: ``accelerate launch`` of the arm's script (the GRPO
    example, or the RLOO arms' `benchmarks.grpo.rloo_train`), wrapped by ``tests/helpers/loops/run_example.py``
    (which records each rank's peak RSS)."""
    config = REPO / configs_of(arm.name) / arm.config
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    launch += ["--main_process_port", "0", str(RUN_EXAMPLE)]
    out = run_dir / "out"
    script = REPO / script_of(arm.name)
    return {"cmd": [*launch, str(script), *script_args(arm, opts, out)], "out": out, "rss": out / "rss"}


def arm_order(arms: list[str], repeat: int) -> list[str]:
    """The arms of one repeat, in reverse order every other repeat (what runs first pays for a cold machine)."""
    return list(arms) if repeat % 2 == 0 else list(reversed(arms))


def run_arm(name: str, opts: argparse.Namespace, run_dir: Path, repeat: int) -> dict:
    """Launch one run of arm ``name``; return its record with command, wall time and load."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    proc = command(ARMS[name], opts, run_dir)
    load_before = os.getloadavg()[0]
    extra_env = VLLM_ENV if name in VLLM_ARMS else None
    wall = _run_processes([proc], run_dir, opts.timeout, opts.allocator, extra_env=extra_env)
    load_after = os.getloadavg()[0]
    state = json.loads((proc["out"] / "trainer_state.json").read_text())
    _trim(proc["out"])
    (proc["out"] / "tokenizer.json").unlink(missing_ok=True)  # 19 MB per run, saved with the model
    record = make_record(name, parse_log_history(state["log_history"]), read_rss(proc["rss"]), opts.warmup, repeat)
    record.update(command=shlex.join(proc["cmd"]), wall_s=wall, load_1min=[load_before, load_after])
    return record


def run(opts: argparse.Namespace, argv: list[str]) -> dict:
    """Every arm of ``opts.arms``, ``opts.repeats`` times interleaved; the aggregated result with every run's record.

    Args:
        opts (`argparse.Namespace`): the parsed command line (`benchmarks.grpo.cli.parse_args`).
        argv (`list[str]`): the command line, recorded in the result.
    """
    for script in sorted({REPO / script_of(name) for name in opts.arms}):
        if not script.is_file():
            raise SystemExit(f"{script} not found: run the benchmark from a source checkout of odc_accelerate.")
    world = world_size_of(REPO / CONFIGS / ARMS["odc"].config)
    runs: dict[str, list[dict]] = {a: [] for a in opts.arms}
    loads = []
    started = time.perf_counter()
    for rep in range(opts.repeats):
        for name in arm_order(opts.arms, rep):
            print(f"[{time.perf_counter() - started:7.0f}s] repeat {rep + 1}/{opts.repeats}: {name} ...", flush=True)
            record = run_arm(name, opts, opts.out / "runs" / name / f"rep{rep}", rep)
            runs[name].append(record)
            loads += record["load_1min"]
            s = record["summary"]
            print(
                f"          {s['step_s']:.2f} s/step, generation {_fmt(s['generation_s'])} s, training "
                f"{_fmt(s['training_s'])} s, wait {_fmt(s['wait_s'])} s per rank; completions "
                f"{s['completion_mean_length']:.0f} / {s['completion_max_length']:.0f} tokens (mean / max); wall "
                f"{record['wall_s']:.0f} s",
                flush=True,
            )
    result = aggregate(runs)

    result["config"] = {
        "script": SCRIPT,
        "scripts": {n: script_of(n) for n in opts.arms},
        "command": "python -m benchmarks.grpo " + shlex.join(argv),
        "world_size": world,
        "arms": opts.arms,
        "repeats": opts.repeats,
        "max_steps": opts.max_steps,
        "warmup": opts.warmup,
        "per_device_train_batch_size": opts.batch,
        "gradient_accumulation_steps": opts.grad_accum,
        "num_generations": opts.num_generations,
        "completions_per_step": opts.batch * opts.grad_accum * world,
        "max_completion_length": opts.max_completion_length,
        "seed": opts.seed,
        "script_args": opts.extra,
        "arm_definitions": {n: asdict(ARMS[n]) for n in opts.arms},
    }
    result["conditions"] = run_conditions(loads, started, opts.allocator, ("accelerate", "trl"))
    result["runs"] = runs
    return result


def _fmt(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)
