"""``python -m odc_accelerate.bench sft`` (and ``dpo``): the real training example, end to end, arm against arm.

Each arm runs the example script (``examples/sft/train.py``, ``examples/dpo/train.py``) with ``accelerate launch`` on
2 CPU processes (one thread each), on the same model, data and samples per optimizer step; only the way the step is
split over ranks and the communication change:

* ``fsdp2_random``: plain FSDP2, the Trainer's default random sampling (``per_device_train_batch_size`` samples per
  microbatch, ``gradient_accumulation_steps`` microbatches per rank and step);
* ``fsdp2_rebalance``: plain FSDP2 with transformers' ``BatchRebalanceSampler``
  (``--train_sampling_strategy batch_rebalance``);
* ``fsdp2_lockstep``: plain FSDP2 on this package's ``lockstep`` plan (``--odc_balance lockstep``: equal microbatch
  counts, each slot balanced over ranks);
* ``odc``: FSDP2 + ODC on this package's ``odc`` plan (``--odc true``: each rank's total balanced, one sync per step);
* ``limit``: the physical limit, mean per-rank compute with zero communication, MEASURED: W independent single
  processes (no process group, no FSDP) run at the same time, each the whole global step of the ``odc`` plan's
  sampler (same samples per step); a rank's share is the step time / W. Running W of them at once keeps the machine
  as loaded as a W-rank job.

The planned arms pack several samples into one microbatch; on SFT they collate padding-free (``--padding_free
true``: one packed row, no padding computed), while the random / batch_rebalance arms run one sample per microbatch
(unpadded either way). TRL 1.16 has no padding-free DPO, so planned DPO microbatches are padded.

Every process records its steps' microbatch shapes (``ODC_TRACE_DIR``, `odc_accelerate.telemetry.StepTrace`); they are
kept in ``results.json`` for ``python -m odc_accelerate.sim validate-e2e``.

Repeats are interleaved (every arm once, then every arm again, ...), so that machine noise hits all arms alike. With
``ODC_TIME_COLLECTIVES=1`` the trainer logs for every run, per optimizer step: step time, real (non-padding) tokens
of all ranks, per-rank busy and wait (seconds blocked in collectives or ODC barriers; FSDP2's collectives are made
synchronous to be timed, see `odc_accelerate.telemetry`) and the bubble. Per run the first ``--warmup`` steps are
dropped; tokens/s = real tokens of the measured steps / their summed step time; the reported figure of an arm is the
median over repeats (per-rank peak RSS: the maximum). Speedups are ratios of tokens/s: arms with a different sampler
see different samples in a step, so equal tokens, not equal steps, are what compares.

Memory allocator: by default (``--allocator caching``) every arm runs with glibc set to keep freed blocks for reuse
(``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``). With glibc's defaults each block above 32 MiB is a fresh
mmap that is page-faulted in at first touch and unmapped at free, every microbatch; GPU training does not pay that
(the CUDA caching allocator reuses blocks), and on this tiny model it was over half of the step time. ``--allocator
system`` measures with the defaults.

Writes ``OUT/results.json``, ``OUT/table.txt``, ``OUT/README_snippet.md``, ``OUT/e2e_<workload>.png`` (with
matplotlib) and every run's log and ``trainer_state.json`` under ``OUT/runs/``. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# Targets of the issue for ODC + plan (checked and reported, never asserted).
TARGETS = {"odc_vs_fsdp2_random": 1.3, "odc_vs_fsdp2_rebalance": 1.15, "odc_bubble_pct_max": 5.0}


@dataclass(frozen=True)
class Arm:
    """One way to run the example: an accelerate config of the workload plus script arguments.

    Attributes:
        name (`str`): key in the results. label (`str`): what tables and plots show.
        config (`str` or `None`): accelerate config file in the workload's ``configs`` folder; `None`: the limit (W
            single processes without accelerate).
        args (`tuple[str, ...]`): extra script arguments.
        planned (`bool`): samples per step go through this package's sampler (``--odc_samples_per_step``).
    """

    name: str
    label: str
    config: str | None
    args: tuple[str, ...] = ()
    planned: bool = False


ARMS: dict[str, Arm] = {
    a.name: a
    for a in (
        Arm("fsdp2_random", "FSDP2 + random", "fsdp2_cpu.yaml"),
        Arm(
            "fsdp2_rebalance",
            "FSDP2 + batch_rebalance",
            "fsdp2_cpu.yaml",
            ("--train_sampling_strategy", "batch_rebalance"),
        ),
        Arm("fsdp2_lockstep", "FSDP2 + plan lockstep", "fsdp2_cpu.yaml", ("--odc_balance", "lockstep"), planned=True),
        Arm("odc", "ODC + plan odc", "odc_cpu.yaml", ("--odc", "true"), planned=True),
        Arm("limit", "limit (no comm)", None, ("--odc_balance", "odc"), planned=True),
    )
}
BASELINES = ("fsdp2_random", "fsdp2_rebalance")


@dataclass(frozen=True)
class Workload:
    """One example script and its default sizes. To add a benchmark, add an entry to `WORKLOADS` and a line to
    ``odc_accelerate/bench/__main__.py``.

    Attributes:
        script (`str`), configs (`str`): paths relative to the repository root.
        batch (`int`), grad_accum (`int`), max_length (`int`), max_steps (`int`): defaults of the full run.
        arms (`tuple[str, ...]`): arms run by default (the limit is added unless ``--no_limit``).
        replaced (`dict`): argument values the offline example silently replaces (its CPU defaults): refused.
        args (`tuple[str, ...]`): script arguments for every arm.
        planned_args (`tuple[str, ...]`): script arguments for the arms on this package's plan (which pack several
            samples into one microbatch).
        unsupported (`dict[str, str]`): arms that cannot run on this workload, with the reason.
    """

    name: str
    script: str
    configs: str
    batch: int
    grad_accum: int
    max_length: int
    max_steps: int
    arms: tuple[str, ...] = ("fsdp2_random", "fsdp2_rebalance", "fsdp2_lockstep", "odc")
    replaced: dict[str, int] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    planned_args: tuple[str, ...] = ()
    unsupported: dict[str, str] = field(default_factory=dict)


WORKLOADS: dict[str, Workload] = {
    "sft": Workload(
        "sft",
        "examples/sft/train.py",
        "examples/sft/configs",
        batch=1,
        grad_accum=4,
        max_length=512,
        max_steps=6,
        replaced={"max_length": 1024, "per_device_train_batch_size": 8},
        # A plan packs several samples into one microbatch: padding-free collation (one packed row, each sequence
        # attending to itself) computes no padding. The FSDP2 random / batch_rebalance arms run one sample per
        # microbatch, which has no padding either way.
        planned_args=("--padding_free", "true"),
    ),
    "dpo": Workload(
        "dpo",
        "examples/dpo/train.py",
        "examples/dpo/configs",
        batch=1,
        grad_accum=2,
        max_length=512,
        max_steps=5,
        arms=("fsdp2_random", "fsdp2_lockstep", "odc"),
        replaced={"max_length": 1024, "per_device_train_batch_size": 8},
        unsupported={
            "fsdp2_rebalance": "transformers' BatchRebalanceSampler reads lengths from an `input_ids` or `length` "
            "column; TRL's tokenized preference data has prompt_ids / chosen_ids / rejected_ids only, so the Trainer "
            "raises before training (it would need a `length` column added after tokenization)",
        },
    ),
}

QUICK = dict(arms=("fsdp2_random", "odc"), repeats=1, max_steps=2, warmup=1, max_length=64, batch=1, grad_accum=2)


# ---------------------------------------------------------------------------------------------------- running


def world_size_of(config_path: Path) -> int:
    import yaml

    with open(config_path, encoding="utf-8") as f:
        return int(yaml.safe_load(f).get("num_processes", 1))


# "caching": glibc keeps freed blocks for reuse instead of unmapping them (why: the module docstring).
CACHING_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}
ALLOCATORS = ("caching", "system")


def allocator_env(allocator: str) -> dict[str, str]:
    """The variables that select ``allocator`` for the runs (on glibc; elsewhere the system allocator runs as is)."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, got {allocator!r}")
    if allocator == "system" or platform.libc_ver()[0] != "glibc":
        return {}
    return dict(CACHING_MALLOC)


def _env(allocator: str = "caching") -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith(("ODC_", "ACCELERATE_", "FSDP_")) or k in CACHING_MALLOC) or k == "ODC_CACHE"
    }
    env.update(allocator_env(allocator))
    path = env.get("PYTHONPATH")
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        ODC_TIME_COLLECTIVES="1",
        PYTHONPATH=f"{REPO}{os.pathsep}{path}" if path else str(REPO),
    )
    return env


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
    worker = [sys.executable, "-m", "odc_accelerate.bench._e2e_worker"]
    if arm.config is None:
        return [
            {
                "cmd": [*worker, script, *script_args(workload, arm, opts, world, run_dir / f"p{i}")],
                "out": run_dir / f"p{i}",
                "rss": run_dir / f"p{i}" / "rss",
            }
            for i in range(world)
        ]
    config = REPO / workload.configs / arm.config
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    launch += ["--main_process_port", "0", "-m", "odc_accelerate.bench._e2e_worker"]
    out = run_dir / "out"
    return [{"cmd": [*launch, script, *script_args(workload, arm, opts, world, out)], "out": out, "rss": out / "rss"}]


def _run_processes(procs: list[dict], run_dir: Path, timeout: float, allocator: str = "caching") -> float:
    env = _env(allocator)
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


def parse_log_history(log_history: list[dict]) -> list[dict]:
    """Per-step figures from ``trainer_state.json``'s ``log_history`` (``--logging_steps 1``)."""
    steps = []
    for row in log_history:
        if "odc/step_s" not in row:
            continue
        ranks = sorted(int(k[len("odc/busy_s_rank") :]) for k in row if k.startswith("odc/busy_s_rank"))
        step_s = float(row["odc/step_s"])
        steps.append(
            {
                "step": int(row.get("step", len(steps) + 1)),
                "step_s": step_s,
                # the trainer logs tokens/s rounded to 0.1 and step_s to 0.1 ms: tokens come back to within 1
                "tokens": round(float(row["odc/tokens_per_s"]) * step_s),
                "busy_s": [float(row[f"odc/busy_s_rank{r}"]) for r in ranks],
                "wait_s": [float(row[f"odc/wait_s_rank{r}"]) for r in ranks],
                "bubble_pct": float(row.get("odc/bubble_pct", 0.0)),
                "microbatches": [int(row.get("odc/microbatches_min", 0)), int(row.get("odc/microbatches_max", 0))],
            }
        )
    return steps


def summarize_run(steps: list[dict], warmup: int, share: int = 1) -> dict:
    """One run's figures over its measured steps (the first ``warmup`` steps dropped).

    ``share``: how many ranks' work one process did (the limit: W; a rank's share of the step is step time / W).
    """
    measured = steps[warmup:]
    if not measured:
        raise ValueError(f"no measured step: {len(steps)} logged step(s), warmup {warmup}; raise --max_steps")
    times = [s["step_s"] / share for s in measured]
    tokens = sum(s["tokens"] for s in measured)
    total = sum(times)
    ranks = len(measured[0]["busy_s"]) if share == 1 else share
    if share == 1:
        busy = [statistics.fmean(s["busy_s"][r] for s in measured) for r in range(ranks)]
        wait = [statistics.fmean(s["wait_s"][r] for s in measured) for r in range(ranks)]
        mean_busy_total = sum(statistics.fmean(s["busy_s"]) for s in measured)
    else:  # W copies of the same compute, no communication
        busy, wait = [total / len(measured)] * ranks, [0.0] * ranks
        mean_busy_total = total
    return {
        "steps_measured": len(measured),
        "step_s_median": statistics.median(times),
        "step_s_mean": total / len(measured),
        "tokens": tokens,
        "tokens_per_s": tokens / total,
        "busy_s": busy,
        "wait_s": wait,
        "bubble_pct": 100.0 * (1.0 - mean_busy_total / total),
        "microbatches": [min(s["microbatches"][0] for s in measured), max(s["microbatches"][1] for s in measured)],
    }


def _read_rss(directory: Path) -> list[float]:
    files = sorted(directory.glob("rss_rank*.json"), key=lambda p: int(p.stem[len("rss_rank") :]))
    return [json.loads(p.read_text())["peak_rss_mb"] for p in files]


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
    wall = _run_processes(procs, run_dir, opts.timeout, opts.allocator)
    load_after = os.getloadavg()[0]
    per_process = []
    for p in procs:
        state = json.loads((p["out"] / "trainer_state.json").read_text())
        per_process.append(parse_log_history(state["log_history"]))
        _trim(p["out"])
    if arm.config is None:
        rss = [max(_read_rss(p["rss"]) or [0.0]) for p in procs]
    else:
        rss = _read_rss(procs[0]["rss"])
    record = make_record(arm, per_process, rss, opts.warmup, world)
    record.update(command=shlex.join(procs[0]["cmd"]), wall_s=wall, load_1min=[load_before, load_after])
    # per process, per rank: the steps' microbatch shapes and times (telemetry.StepTrace), replayed by
    # `python -m odc_accelerate.sim validate-e2e`
    record["trace"] = [read_trace(p["out"] / "trace") for p in procs]
    return record


def read_trace(directory: Path) -> list[list[dict]]:
    """``[rank][step]`` rows of the `odc_accelerate.telemetry.StepTrace` files in ``directory`` (empty if none)."""
    files = sorted(directory.glob("trace_rank*.jsonl"), key=lambda f: int(f.stem[len("trace_rank") :]))
    return [[json.loads(line) for line in f.read_text().splitlines() if line.strip()] for f in files]


def make_record(arm: Arm, per_process: list[list[dict]], rss: list[float], warmup: int, world: int) -> dict:
    """One run's record from the per-step figures of its process(es) (one launch, or the limit's W processes)."""
    share = world if arm.config is None else 1
    summaries = [summarize_run(steps, warmup, share) for steps in per_process]
    return {
        "arm": arm.name,
        "processes": len(per_process),
        "steps": per_process if arm.config is None else per_process[0],  # the limit: one list per process
        "summary": _mean_of(summaries) if len(summaries) > 1 else summaries[0],
        "peak_rss_mb": rss,
    }


def _mean_of(summaries: list[dict]) -> dict:
    """Mean of the limit's concurrent processes (identical work)."""
    out: dict[str, Any] = {}
    for key, value in summaries[0].items():
        if isinstance(value, list):
            out[key] = [statistics.fmean(s[key][i] for s in summaries) for i in range(len(value))]
        elif key in ("steps_measured", "tokens"):
            out[key] = value
        else:
            out[key] = statistics.fmean(s[key] for s in summaries)
    return out


# ---------------------------------------------------------------------------------------------------- aggregation


def _median_run(runs: list[dict]) -> dict:
    """The run whose tokens/s is the median (the lower middle one for an even count)."""
    ordered = sorted(runs, key=lambda r: r["summary"]["tokens_per_s"])
    return ordered[(len(ordered) - 1) // 2]


def _by_repeat(runs: list[dict]) -> list[dict]:
    return sorted(runs, key=lambda r: r.get("repeat", 0))


def aggregate(runs: dict[str, list[dict]], world: int) -> dict:
    """Per-arm medians over repeats, speedups (ratios of tokens/s), distance to the limit, targets."""
    arms: dict[str, dict] = {}
    for name, arm_runs in runs.items():
        sums = [r["summary"] for r in arm_runs]
        med = {
            "repeats": len(arm_runs),
            "step_s": statistics.median(s["step_s_median"] for s in sums),
            "tokens_per_s": statistics.median(s["tokens_per_s"] for s in sums),
            "bubble_pct": statistics.median(s["bubble_pct"] for s in sums),
            "busy_s": [statistics.median(s["busy_s"][r] for s in sums) for r in range(world)],
            "wait_s": [statistics.median(s["wait_s"][r] for s in sums) for r in range(world)],
            "peak_rss_mb": [
                max(r["peak_rss_mb"][i] for r in arm_runs) for i in range(len(arm_runs[0]["peak_rss_mb"]))
            ],
            "microbatches": [min(s["microbatches"][0] for s in sums), max(s["microbatches"][1] for s in sums)],
            "tokens_per_s_runs": [s["tokens_per_s"] for s in sums],
            "step_s_runs": [s["step_s_median"] for s in sums],
        }
        med["label"] = ARMS[name].label
        # A trainer that did not time this arm's collectives logs wait = 0 on every step: say so, claim no bubble.
        med["wait_measured"] = ARMS[name].config is None or any(w > 0 for s in sums for w in s["wait_s"])
        if not med["wait_measured"]:
            med["bubble_pct"], med["wait_s"] = None, None
        arms[name] = med
    for a in arms.values():
        for base in BASELINES:
            if base in arms:
                a[f"speedup_vs_{base}"] = a["tokens_per_s"] / arms[base]["tokens_per_s"]
        if "limit" in arms:
            # < 1: slower than the limit; 1 - this is the share of the limit's throughput the arm loses
            a["of_limit"] = a["tokens_per_s"] / arms["limit"]["tokens_per_s"]
    out: dict[str, Any] = {"arms": arms}
    if "odc" in arms:
        odc = arms["odc"]
        # A second, cruder limit: tokens over ODC's mean busy time (compute plus ODC's own copies and adds).
        out["limit_from_odc_busy_tokens_per_s"] = statistics.median(
            r["summary"]["tokens_per_s"] / (1.0 - r["summary"]["bubble_pct"] / 100.0) for r in runs["odc"]
        )
        targets = {}
        for base, key in (("fsdp2_random", "odc_vs_fsdp2_random"), ("fsdp2_rebalance", "odc_vs_fsdp2_rebalance")):
            if base in arms:
                value = odc[f"speedup_vs_{base}"]
                targets[key] = {"value": value, "target": f">= {TARGETS[key]}", "met": value >= TARGETS[key]}
                # The spread: each repeat's ratio, from the two arms' runs that ran next to each other.
                pairs = zip(_by_repeat(runs["odc"]), _by_repeat(runs[base]), strict=False)
                targets[key]["per_repeat"] = [
                    o["summary"]["tokens_per_s"] / b["summary"]["tokens_per_s"] for o, b in pairs
                ]
        bubble = odc["bubble_pct"]
        targets["odc_bubble_pct"] = {
            "value": bubble,
            "target": f"<= {TARGETS['odc_bubble_pct_max']}",
            "met": None if bubble is None else bubble <= TARGETS["odc_bubble_pct_max"],
        }
        out["targets"] = targets
    out["timeline"] = {name: _timeline(arm_runs, world, name == "limit") for name, arm_runs in runs.items()}
    return out


def _timeline(arm_runs: list[dict], world: int, limit: bool) -> dict:
    """One representative step: the median-step-time step of the median run (per rank: busy, then wait)."""
    run = _median_run(arm_runs)
    steps = run["steps"][0] if limit else run["steps"]
    measured = steps[len(steps) - run["summary"]["steps_measured"] :]
    target = statistics.median(s["step_s"] for s in measured)
    step = min(measured, key=lambda s: abs(s["step_s"] - target))
    if limit:
        share = step["step_s"] / world
        return {
            "repeat": run["repeat"],
            "step": step["step"],
            "step_s": share,
            "busy_s": [share] * world,
            "wait_s": [0.0] * world,
        }
    return {k: step[k] for k in ("step", "step_s", "busy_s", "wait_s")} | {"repeat": run["repeat"]}


# ---------------------------------------------------------------------------------------------------- reporting


def _fmt_list(values: list[float], fmt: str) -> str:
    return " ".join(format(v, fmt) for v in values)


def table_rows(result: dict) -> list[list[str]]:
    arms = result["arms"]
    head = ["arm", "step s", "real tok/s", "bubble %", "busy s/rank", "wait s/rank", "peak RSS MB/rank"]
    head += [f"vs {ARMS[b].label.split(' + ')[1]}" for b in BASELINES if b in arms]
    head += ["of limit"] if "limit" in arms else []
    rows = [head]
    for name in [n for n in ARMS if n in arms]:
        a = arms[name]
        limit = name == "limit"
        row = [
            a["label"],
            f"{a['step_s']:.2f}",
            f"{a['tokens_per_s']:.1f}",
            "-" if limit else "n/m" if a["bubble_pct"] is None else f"{a['bubble_pct']:.1f}",
            _fmt_list(a["busy_s"], ".2f"),
            "-" if limit else "n/m" if a["wait_s"] is None else _fmt_list(a["wait_s"], ".2f"),
            _fmt_list(a["peak_rss_mb"], ".0f") + (" (1 proc, unsharded)" if limit else ""),
        ]
        row += [f"{a[f'speedup_vs_{b}']:.2f}x" for b in BASELINES if b in arms]
        row += [f"{a['of_limit']:.2f}"] if "limit" in arms else []
        rows.append(row)
    return rows


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def _targets_text(result: dict) -> list[str]:
    names = {
        "odc_vs_fsdp2_random": "ODC tokens/s over FSDP2 + random",
        "odc_vs_fsdp2_rebalance": "ODC tokens/s over FSDP2 + batch_rebalance",
        "odc_bubble_pct": "ODC bubble %",
    }
    lines = []
    for key, t in result.get("targets", {}).items():
        if t["value"] is None:
            lines.append(f"{names[key]:<44}{'n/m':>8}  (target {t['target']}: not measured)")
            continue
        # three decimals for ratios: at two, 1.295 prints as 1.30x next to "NOT met" for a 1.3 target
        value = f"{t['value']:.3f}x" if "vs" in key else f"{t['value']:.2f}"
        spread = ""
        if len(t.get("per_repeat") or []) > 1:
            spread = f"; per repeat {min(t['per_repeat']):.3f}x to {max(t['per_repeat']):.3f}x"
        lines.append(f"{names[key]:<44}{value:>8}  (target {t['target']}: {'met' if t['met'] else 'NOT met'}{spread})")
    if result.get("limit_from_odc_busy_tokens_per_s"):
        lines.append(
            f"{'limit estimated from ODC mean busy time':<44}{result['limit_from_odc_busy_tokens_per_s']:>8.1f}  "
            "tok/s (busy includes ODC's own copies and adds: a lower bound on the limit's tokens/s)"
        )
    if any(not a["wait_measured"] for a in result["arms"].values()):
        lines.append(
            "n/m: the trainer logged no wait for this arm (its collectives were not timed), so no bubble is claimed."
        )
    return lines


def conditions_text(result: dict) -> str:
    c = result["config"]
    cond = result["conditions"]
    return (
        f"{c['world_size']} CPU processes x 1 thread, {c['workload']} example (offline tiny Qwen2, pydoc text), "
        f"max_length {c['max_length']}, {c['samples_per_step']} {'pairs' if c['workload'] == 'dpo' else 'samples'} "
        "per optimizer step "
        f"(FSDP2 arms: {c['per_device_train_batch_size']} per microbatch x {c['gradient_accumulation_steps']} "
        f"accumulation x {c['world_size']} ranks), {c['max_steps']} steps per run of which the first "
        f"{c['warmup']} dropped, {c['repeats']} interleaved repeats; 1-min load average {cond['load_min']:.1f} to "
        f"{cond['load_max']:.1f} on {cond['cpus']} cores; "
        f"{_allocator_text(cond)}; {cond['date']}"
    )


def _allocator_text(cond: dict) -> str:
    if "allocator" not in cond:  # runs recorded before the option existed used glibc's defaults
        return "system allocator"
    if cond["allocator"] == "caching" and not cond.get("allocator_env"):
        return "system allocator (caching asked, not glibc)"
    return f"{cond['allocator']} allocator"


def write_outputs(result: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    rows = table_rows(result)
    table = text_table(rows)
    files = {"json": out / "results.json", "table": out / "table.txt", "snippet": out / "README_snippet.md"}
    files["json"].write_text(json.dumps(result, indent=1))
    files["table"].write_text(
        conditions_text(result) + "\n\n" + table + "\n\n" + "\n".join(_targets_text(result)) + "\n"
    )
    png = out / f"e2e_{result['config']['workload']}.png"
    plotted = plot(result, png)
    if plotted:
        files["png"] = png
    snippet = [
        "```bash",
        result["config"]["command"],
        "```",
        "",
        conditions_text(result) + ".",
        "",
        markdown_table(rows),
        "",
        *[f"- {line}" for line in _targets_text(result)],
    ]
    if plotted:
        snippet += ["", f"![per-rank busy/wait and tokens/s]({png.name})"]
    files["snippet"].write_text("\n".join(snippet) + "\n")
    return files


def plot(result: dict, path: Path) -> bool:
    """Per-rank busy/wait of one step per arm (left) and tokens/s per arm (right); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed: no PNG written (pip install matplotlib, or pip install -e '.[bench]').",
            file=sys.stderr,
        )
        return False
    arms = result["arms"]
    names = [n for n in ARMS if n in arms]
    world = result["config"]["world_size"]
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 0.55 * len(names) * world + 2.2), width_ratios=(3, 2))
    labels, ticks, y = [], [], 0.0
    for name in reversed(names):
        t = result["timeline"][name]
        for r in reversed(range(world)):
            busy, wait = t["busy_s"][r], t["wait_s"][r]
            ax_t.barh(y, busy, color="tab:blue" if name != "limit" else "tab:green", height=0.8)
            ax_t.barh(y, wait, left=busy, color="tab:red", alpha=0.6, height=0.8)
            untimed = "" if arms[name]["wait_measured"] else " (wait not timed)"
            labels.append(f"{arms[name]['label']}{untimed}  r{r}")
            ticks.append(y)
            y += 1
        y += 0.6
    ax_t.set_yticks(ticks, labels, fontsize=8)
    ax_t.set_xlabel("seconds in one optimizer step (median step of the median run)")
    ax_t.set_title("per rank: busy (blue), waiting in collectives / barriers (red)", fontsize=9)
    ax_b.barh(range(len(names)), [arms[n]["tokens_per_s"] for n in reversed(names)], color="tab:gray")
    ax_b.set_yticks(range(len(names)), [arms[n]["label"] for n in reversed(names)], fontsize=8)
    for i, n in enumerate(reversed(names)):
        text = f"{arms[n]['tokens_per_s']:.0f}"
        if "speedup_vs_fsdp2_random" in arms[n] and n != "fsdp2_random":
            text += f"  ({arms[n]['speedup_vs_fsdp2_random']:.2f}x vs random)"
        ax_b.text(arms[n]["tokens_per_s"], i, " " + text, va="center", fontsize=8)
    ax_b.set_xlabel("real (non-padding) tokens/s, median over repeats")
    ax_b.set_xlim(0, 1.75 * max(a["tokens_per_s"] for a in arms.values()))
    fig.suptitle(conditions_text(result), fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------------- CLI


def _parse(argv: list[str]) -> tuple[Workload, argparse.Namespace]:
    if not argv or argv[0] not in WORKLOADS:
        raise SystemExit(f"usage: python -m odc_accelerate.bench <{'|'.join(WORKLOADS)}> [options] [-- script args]")
    workload = WORKLOADS[argv[0]]
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(
        prog=f"python -m odc_accelerate.bench {workload.name}",
        description=f"{workload.script} end to end: FSDP2 (random / batch_rebalance / lockstep plan) vs ODC, 2 CPU "
        "processes, interleaved repeats. Arguments after `--` go to the script of every arm.",
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
    p.add_argument("--out", type=Path, default=None, help=f"output folder (default bench_e2e_{workload.name})")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
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
        p.set_defaults(**{k: ",".join(v) if k == "arms" else v for k, v in QUICK.items()})
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
    # absolute: the runs start in the repository root, the harness may not
    opts.out = (opts.out or Path(f"bench_e2e_{workload.name}")).resolve()
    opts.report = opts.report.resolve() if opts.report is not None else None
    return workload, opts


def run(workload: Workload, opts: argparse.Namespace, argv: list[str]) -> dict:
    script = REPO / workload.script
    if not script.is_file():
        raise SystemExit(f"{script} not found: run the benchmark from a source checkout of odc_accelerate.")
    world = world_size_of(REPO / workload.configs / ARMS["odc"].config)
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
                f"{s['bubble_pct']:.1f}%, wall {result['wall_s']:.0f} s",
                flush=True,
            )
    result = aggregate(runs, world)
    import torch
    import transformers

    result["config"] = {
        "workload": workload.name,
        "script": workload.script,
        "command": "python -m odc_accelerate.bench " + shlex.join(argv),
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
        "arm_definitions": {n: asdict(ARMS[n]) for n in opts.arms},
    }
    result["conditions"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "load_min": min(loads),
        "load_max": max(loads),
        "wall_s": time.perf_counter() - started,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git": _git_head(),
        "allocator": opts.allocator,
        "allocator_env": allocator_env(opts.allocator),
    }
    result["runs"] = runs
    return result


def _git_head() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    workload, opts = _parse(argv)
    if opts.report is not None:
        result = json.loads((opts.report / "results.json").read_text())
        result.update(aggregate(result["runs"], result["config"]["world_size"]))
        out = opts.report
    else:
        result, out = run(workload, opts, argv), opts.out
    files = write_outputs(result, out)
    print()
    print(conditions_text(result))
    print()
    print(text_table(table_rows(result)))
    print()
    print("\n".join(_targets_text(result)))
    print()
    for kind, path in files.items():
        print(f"{kind:8s} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
