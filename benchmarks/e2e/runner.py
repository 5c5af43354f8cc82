"""Launching the end-to-end benchmark's runs: every arm's processes, interleaved repeats, what each run recorded."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks import REPO
from benchmarks.e2e.aggregate import aggregate
from benchmarks.e2e.arms import ARMS, Arm, Workload
from benchmarks.e2e.environment import allocator_env, run_env
from benchmarks.e2e.records import make_record, padding_pct, parse_log_history, read_rss, read_trace

RUN_EXAMPLE = REPO / "tests" / "helpers" / "loops" / "run_example.py"
"""Runs an example script unchanged; with ``ODC_BENCH_RSS_DIR`` set it writes ``rss_rank<RANK>.json`` there at exit."""


def world_size_of(config_path: Path) -> int:
    """``num_processes`` of an accelerate config file."""
    import yaml

    with open(config_path, encoding="utf-8") as f:
        return int(yaml.safe_load(f).get("num_processes", 1))


def script_args(workload: Workload, arm: Arm, opts: argparse.Namespace, world: int, output_dir: Path) -> list[str]:
    """Arguments of the example script for one arm (every arm: same sizes, same samples per optimizer step)."""
    samples = opts.batch * opts.grad_accum * world
    args = [
        "--max_steps", str(opts.max_steps),
        "--logging_steps", "1",
        "--save_strategy", "no",
        "--report_to", "none",
        "--per_device_train_batch_size", str(opts.batch),
        "--gradient_accumulation_steps", str(opts.grad_accum),
        "--max_length", str(opts.max_length),
        "--seed", str(opts.seed),
        "--output_dir", str(output_dir),
        *workload.args,
        *arm.args,
    ]  # fmt: skip
    if arm.planned:
        args += ["--odc_samples_per_step", str(samples), *workload.planned_args]
    return args + list(opts.extra)


def commands(workload: Workload, arm: Arm, opts: argparse.Namespace, world: int, run_dir: Path) -> list[dict]:
    """The processes of one run: ``[{"cmd", "out", "rss"}]``; the limit has W of them, run at the same time."""
    script = str(REPO / workload.script)
    if arm.config is None:
        return [
            {
                "cmd": [sys.executable, str(RUN_EXAMPLE), script, *script_args(workload, arm, opts, world, out)],
                "out": out,
                "rss": out / "rss",
            }
            for out in (run_dir / f"p{i}" for i in range(world))
        ]
    config = REPO / workload.configs / workload.config_of(arm)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    launch += [*arm.launch_args, "--main_process_port", "0", str(RUN_EXAMPLE)]
    out = run_dir / "out"
    return [{"cmd": [*launch, script, *script_args(workload, arm, opts, world, out)], "out": out, "rss": out / "rss"}]


def slow_env(opts: argparse.Namespace) -> dict[str, str]:
    """The slowed-rank condition's variables (read by ``run_example.py``): rank ``slow_rank``'s every microbatch is
    followed, inside its timed compute, by a sleep of ``slow_factor - 1`` times the microbatch's measured compute."""
    rank = getattr(opts, "slow_rank", None)
    if rank is None:
        return {}
    return {"ODC_BENCH_SLOW_RANK": str(rank), "ODC_BENCH_SLOW_FACTOR": str(opts.slow_factor)}


def _run_processes(
    procs: list[dict], run_dir: Path, timeout: float, allocator: str = "caching", extra_env: dict | None = None
) -> float:
    env = dict(run_env(allocator), **(extra_env or {}))
    run_dir.mkdir(parents=True, exist_ok=True)
    started = []
    start = time.perf_counter()
    for i, p in enumerate(procs):
        p["out"].mkdir(parents=True, exist_ok=True)
        log = open(run_dir / f"log{i}.txt", "w")  # closed once the process has ended
        log.write(shlex.join(p["cmd"]) + "\n\n")
        log.flush()
        penv = dict(env, ODC_BENCH_RSS_DIR=str(p["rss"]), ODC_TRACE_DIR=str(p["out"] / "trace"))
        child = subprocess.Popen(
            p["cmd"], cwd=REPO, env=penv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        started.append((child, log))
    failed = []
    try:
        for i, (child, log) in enumerate(started):
            left = max(1.0, timeout - (time.perf_counter() - start))
            try:
                rc = child.wait(timeout=left)
            except subprocess.TimeoutExpired:
                _kill(child)
                rc = "timeout"
            log.close()
            if rc != 0:
                failed.append((i, rc))
    except BaseException:  # e.g. Ctrl-C: the children run in sessions of their own and would outlive us
        for child, log in started:
            _kill(child)
            log.close()
        raise
    wall = time.perf_counter() - start
    if failed:
        i, rc = failed[0]
        text = (run_dir / f"log{i}.txt").read_text(errors="replace")
        errors = [line for line in text.splitlines() if re.search(r"\w(Error|Exception)\b", line)][:6]
        raise RuntimeError(
            f"run {run_dir} failed (exit {rc}); errors in {run_dir / f'log{i}.txt'}:\n"
            + "\n".join(errors or ["(none found)"])
            + f"\n--- end of the log ---\n{text[-3000:]}"
        )
    return wall


def _kill(child: subprocess.Popen) -> None:
    """End a run we started: its launcher and workers (a session of their own, so one process group)."""
    if child.poll() is None:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    child.wait()


def _trim(out: Path) -> None:
    """Drop the saved model of a run (tens of MB each); keep logs, trainer_state.json and the run reports."""
    for p in out.iterdir():
        if (
            p.is_file()
            and p.suffix in (".safetensors", ".bin", ".pt")
            or p.is_dir()
            and p.name.startswith("checkpoint")
        ):
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def run_arm(workload: Workload, arm: Arm, opts: argparse.Namespace, world: int, run_dir: Path) -> dict:
    """Launch one run of ``arm``; return its per-step figures, summary, peak RSS per rank, wall time and load."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    procs = commands(workload, arm, opts, world, run_dir)
    load_before = os.getloadavg()[0]
    wall = _run_processes(procs, run_dir, opts.timeout, opts.allocator, slow_env(opts))
    load_after = os.getloadavg()[0]
    per_process = []
    for p in procs:
        state = json.loads((p["out"] / "trainer_state.json").read_text())
        per_process.append(parse_log_history(state["log_history"]))
        _trim(p["out"])
    if arm.config is None:
        rss = [max(read_rss(p["rss"]) or [0.0]) for p in procs]
    else:
        rss = read_rss(procs[0]["rss"])
    record = make_record(arm, per_process, rss, opts.warmup, world)
    record.update(command=shlex.join(procs[0]["cmd"]), wall_s=wall, load_1min=[load_before, load_after])
    # per process, per rank: the steps' microbatch shapes and times (telemetry.StepTrace), replayed by
    # `python -m benchmarks.sim validate-e2e`
    record["trace"] = [read_trace(p["out"] / "trace") for p in procs]
    # the share of the computed tokens that were padding (TRL's padded DPO pads both rows of a pair)
    record["summary"]["padding_pct"] = padding_pct(record["trace"], opts.warmup)
    return record


def run(workload: Workload, opts: argparse.Namespace, argv: list[str]) -> dict:
    """Every arm of ``opts.arms``, ``opts.repeats`` times interleaved; the aggregated result with every run's record.

    Args:
        workload (`Workload`): the example.
        opts (`argparse.Namespace`): the parsed command line (`benchmarks.e2e.cli.parse_args`).
        argv (`list[str]`): the command line, recorded in the result.
    """
    script = REPO / workload.script
    if not script.is_file():
        raise SystemExit(f"{script} not found: run the benchmark from a source checkout of odc_accelerate.")
    world = world_size_of(REPO / workload.configs / workload.config_of(ARMS["odc"]))
    if workload.data is not None and "--dataset_name" not in opts.extra:
        from benchmarks.e2e.data import DATASETS

        # written once, before the first run: every arm and repeat reads the same files
        opts.extra = [*opts.extra, "--dataset_name", str(DATASETS[workload.data](opts.out / "data"))]
    if getattr(opts, "slow_rank", None) is not None and opts.slow_rank >= world:
        raise SystemExit(f"--slow_rank {opts.slow_rank} is not a rank of the {world}-process runs")
    runs: dict[str, list[dict]] = {a: [] for a in opts.arms}
    loads = []
    started = time.perf_counter()
    for rep in range(opts.repeats):
        for name in opts.arms:  # A B C D (limit), then again: noise hits every arm alike
            run_dir = opts.out / "runs" / name / f"rep{rep}"
            print(f"[{time.perf_counter() - started:7.0f}s] repeat {rep + 1}/{opts.repeats}: {name} ...", flush=True)
            result = run_arm(workload, ARMS[name], opts, world, run_dir)
            result["repeat"] = rep
            runs[name].append(result)
            loads += result["load_1min"]
            s = result["summary"]
            print(
                f"          {s['step_s_median']:.2f} s/step, {s['tokens_per_s']:.1f} tok/s, bubble "
                f"{s['bubble_pct']:.1f}%, padding {_pct(s.get('padding_pct'))}, wall {result['wall_s']:.0f} s",
                flush=True,
            )
    slow = slow_condition(opts, world)
    result = aggregate(runs, world, slow)

    result["config"] = {
        "workload": workload.name,
        "script": workload.script,
        "command": "python -m benchmarks.e2e " + shlex.join(argv),
        "world_size": world,
        "arms": opts.arms,
        "repeats": opts.repeats,
        "max_steps": opts.max_steps,
        "warmup": opts.warmup,
        "per_device_train_batch_size": opts.batch,
        "gradient_accumulation_steps": opts.grad_accum,
        "samples_per_step": opts.batch * opts.grad_accum * world,
        "max_length": opts.max_length,
        "seed": opts.seed,
        "script_args": opts.extra,
        "slow": slow,
        "arm_definitions": {n: asdict(ARMS[n]) for n in opts.arms},
    }
    result["conditions"] = run_conditions(loads, started, opts.allocator)
    result["runs"] = runs
    return result


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}%"


def slow_condition(opts: argparse.Namespace, world: int) -> dict | None:
    """The slowed-rank condition as recorded: which rank, by what factor, and every rank's relative speed."""
    rank = getattr(opts, "slow_rank", None)
    if rank is None:
        return None
    speeds = [1.0 / opts.slow_factor if r == rank else 1.0 for r in range(world)]
    return {"rank": rank, "factor": opts.slow_factor, "speeds": speeds}


def run_conditions(loads: list[float], started: float, allocator: str, libraries: tuple[str, ...] = ()) -> dict:
    """The conditions of a benchmark run: date, CPUs, 1-min load average range, wall time since ``started``
    (``time.perf_counter()``), torch / transformers (and ``libraries``) versions, git commit, allocator."""
    import importlib

    import torch
    import transformers

    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "load_min": min(loads),
        "load_max": max(loads),
        "wall_s": time.perf_counter() - started,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    out.update({name: importlib.import_module(name).__version__ for name in libraries})
    out.update(git=_git_head(), allocator=allocator, allocator_env=allocator_env(allocator))
    return out


def _git_head() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
