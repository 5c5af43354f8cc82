"""Trainer-level check of ODC on one GPU: ``python -m tests.gpu.gpu_trainer --out DIR [--device cuda|cpu]``.

The SFT, DPO and GRPO examples (offline default model, tokenizer and data) under real ``accelerate launch``. On
``cuda`` every rank shares the one GPU over a gloo process group (``--ddp_backend gloo``; NCCL refuses two ranks on
one GPU) with the ``cuda`` transport (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``), and the ODC runs set the
test-only switch ``ODC_TEST_SHARED_GPU=1`` (`shared_gpu.py`: accelerate's barrier on the current device, one default
FSDP2 mesh, no CPU-RAM-efficient loading, state dicts gathered through CPU), on CPU too. Cases:

* ``sft_fp32``: 11 samples per optimizer step, against TRL's own trainer in one process on the same steps
  (`tests/helpers/loops/trl_reference.py`), three ODC runs: 2 ranks (6 and 5 microbatches), 8 ranks (2 or 1 each), and 8
  ranks under the ``dynamic`` plan with the last rank late by construction (it claims none; the other 7 claim the
  step's 11 microbatches, each exactly once). Both sides start from the same weights, the learning rate moves every
  weight tensor on both sides, and the per-step loss and the weight updates (final weights - initial weights) must
  match to fp32 rounding, the updates' difference measured against the update's own norm, as the CPU parity tests
  measure it (a difference measured against the weights would hide a wrong gradient behind a small update);
* ``dpo_fp32``: the same with 2 ranks and 5 samples per step;
* ``sft_bf16``: as ``dpo_fp32``, SFT with bf16 mixed precision on both sides (FSDP2's bf16 parameters against TRL's
  autocast): the differences are reported, and checked against a loose bound only (the two compute in bf16
  differently);
* ``grpo``: the GRPO example for 3 steps: it trains with finite losses and makes no torch.distributed call during
  generation or a training microbatch;
* ``speed``: ODC against its zero-communication limit on a Qwen2.5-0.5B-shaped model (`trainer_speed`), timed, so
  run alone; it writes ``DIR/trainer_speed.json``.

A parity case's runs (its ODC runs and its reference) start at once: they are compared, not timed (on CPU two at a
time). Every ODC run must report the transport it was asked for and leave nothing in ``/dev/shm``. Writes
``DIR/results.json``, ``DIR/summary.txt`` and ``DIR/logs.txt`` (the tail of each failed run's output); exits
non-zero when a check fails. On ``cpu`` the same cases run with the shared-memory transport and no mixed precision
(``sft_bf16`` is left out; the speed case on a tiny model): that tests this driver without a GPU. Needs trl, datasets
and the ``demo`` extra's tokenizer (``scripts/gpu_wheelhouse.sh`` builds them as wheels for a machine without
network).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RUN_EXAMPLE = ROOT / "tests" / "helpers" / "loops" / "run_example.py"
TRL_REFERENCE = ROOT / "tests" / "helpers" / "loops" / "trl_reference.py"
PRESETS = ROOT / "odc_accelerate" / "cli" / "accelerate_configs"
CASES = ("sft_fp32", "dpo_fp32", "sft_bf16", "grpo", "speed")
#: samples per optimizer step (default 5): 11 over 2 ranks is 6 and 5 microbatches, over 8 ranks 2 or 1 each
SAMPLES_PER_STEP = {"sft_fp32": 11}
DEFAULT_SAMPLES_PER_STEP = 5
#: a parity case's ODC runs (default: 2 ranks, plan free) as (world size, plan), all against its one reference run.
#: Under the dynamic plan the last rank claims nothing (``ODC_TEST_LATE_RANK``: it starts claiming once a peer found
#: the queue empty), so the step's 11 microbatches go to 7 ranks and one runs none.
RUNS = {"sft_fp32": ((2, "free"), (8, "free"), (8, "dynamic"))}
SUMMARY_FIGURES = (
    "loss_max_rel", "update_rel", "unmoved", "microbatches_min_max_per_step", "odc_wall_s", "wall_s",
    "peak_mem_mb_per_step", "median_step_s", "ratios", "repeats_run", "profiled",
)  # fmt: skip
#: relative to the norm of the update (loss: to the loss); what the CPU parity tests allow for fp32 summation order
FP32_TOLERANCE = 1e-4
#: relative, as above; bf16 keeps 8 bits of mantissa and the two sides round at different points
BF16_TOLERANCE = 5e-2

COMMON = [
    "--max_steps",
    "2",
    "--logging_steps",
    "1",
    "--report_to",
    "none",
    "--optim",
    "sgd",
    "--seed",
    "0",
    "--dataloader_pin_memory",
    "false",
    "--save_strategy",
    "no",
    "--odc_max_tokens_per_microbatch",
    "128",
]
# Plain SGD at these rates moves every weight tensor of the tiny model on both sides (checked: a tensor that does not
# move tells nothing about its gradient); DPO's gradients are beta (0.1) times smaller than a language-model loss's.
ARGS = {
    "sft": ["--max_length", "128", "--learning_rate", "0.5"],
    "dpo": ["--max_length", "64", "--learning_rate", "0.2"],
}


#: the caller's ODC_* variables the runs keep: the cache, the offline vocabulary, and the test suite's warm start
#: (`tests/helpers/infra/warm_start.py`: where the dry run runs in CI, its processes start as forks of the session's server)
KEPT = ("ODC_CACHE", "ODC_OFFLINE_BPE_RANKS", "ODC_TEST_WARM_START")


def root_first(path: str | None) -> str:
    """``PYTHONPATH`` with the repository first and no entry twice (the same value whichever level sets it)."""
    entries = [str(ROOT), *(e for e in (path or "").split(os.pathsep) if e and e != str(ROOT))]
    return os.pathsep.join(dict.fromkeys(entries))


def _env(device: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ODC_", "ACCELERATE_", "FSDP_")) or k in KEPT}
    env.update(PYTHONPATH=root_first(env.get("PYTHONPATH")), TOKENIZERS_PARALLELISM="false", **extra)
    if device == "cuda":
        env.update(ODC_TRANSPORT="cuda", TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES="1")
    else:
        env.update(ODC_TRANSPORT="shm", OMP_NUM_THREADS="1")
    return env


def _odc_env(device: str, **extra: str) -> dict[str, str]:
    # The ODC runs share one GPU between 2 ranks over gloo (`shared_gpu.py`); on CPU the same switch runs, so that CI
    # exercises it.
    return _env(device, ODC_TEST_SHARED_GPU="1", **extra)


def _config(device: str, precision: str, out: Path, ranks: int = 2) -> Path:
    """An accelerate config for ``ranks`` processes: the package's GPU or CPU preset with the given mixed precision
    (``"no"``: none)."""
    text = (PRESETS / ("odc_gpu.yaml" if device == "cuda" else "odc_cpu.yaml")).read_text()
    lines = []
    for line in text.splitlines():
        if line.startswith("num_processes:"):
            line = f"num_processes: {ranks}"
        elif line.startswith("mixed_precision:"):
            line = "mixed_precision: " + ("bf16" if precision == "bf16" else "'no'")  # bare no is YAML's false
        lines.append(line)
    path = out / f"accelerate_{device}_{precision}_{ranks}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


class Job:
    """A command started in the background, its output in files (several jobs may run at once without a pipe filling
    up); `wait` gives its `subprocess.CompletedProcess`, killing its process group at the timeout."""

    def __init__(self, cmd: list[Any], env: dict[str, str], timeout: float) -> None:
        self.cmd = [str(c) for c in cmd]
        self.deadline = time.monotonic() + timeout
        self.start = time.perf_counter()
        self.out = tempfile.TemporaryFile(mode="w+")
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            self.cmd, cwd=ROOT, env=env, stdout=self.out, stderr=self.err, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        self.wall_s = 0.0

    def wait(self) -> subprocess.CompletedProcess:
        try:
            rc = self.proc.wait(timeout=max(self.deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            rc = -signal.SIGKILL
            self.err.write(f"\n[gpu_trainer] killed at the timeout: {shlex.join(self.cmd)}\n")
        self.wall_s = time.perf_counter() - self.start
        texts = []
        for f in (self.out, self.err):
            f.seek(0)
            texts.append(f.read())
            f.close()
        return subprocess.CompletedProcess(self.cmd, rc, texts[0], texts[1])


def _run(cmd: list[Any], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return Job(cmd, env, timeout).wait()


def _odc_command(trainer: str, device: str, precision: str, out: Path, args: list[str], ranks: int = 2) -> list:
    config = _config(device, precision, out, ranks)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config]
    script = ROOT / "examples" / trainer / "train.py"
    extra = ["--ddp_backend", "gloo"] if device == "cuda" else []
    flags = ["--bf16", "true" if precision == "bf16" else "false"]
    return [*launch, "--main_process_port", "0", RUN_EXAMPLE, script, "--odc", "true", *args, *flags, *extra]


def _odc_run(trainer: str, device: str, precision: str, out: Path, args: list[str], timeout: float, **env: str):
    return _run(_odc_command(trainer, device, precision, out, args), _odc_env(device, **env), timeout)


def _reference_command(trainer: str, device: str, precision: str, samples: int, args: list[str]) -> list:
    kept, skip = [], False
    for arg in args:  # TRL's own trainer takes no --odc options
        if skip:
            skip = False
        elif arg.startswith("--odc"):
            skip = "=" not in arg
        else:
            kept.append(arg)
    flags = ["--bf16", "true" if precision == "bf16" else "false"]
    if device == "cpu":
        flags += ["--use_cpu", "true"]
    return [sys.executable, TRL_REFERENCE, trainer, "--samples_per_step", str(samples), *kept, *flags]


def _losses(out: Path) -> list[float]:
    state = json.loads((out / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


def _microbatch_counts(out: Path) -> list[list[int]]:
    """Per logged step, the fewest and the most microbatches a rank ran."""
    state = json.loads((out / "trainer_state.json").read_text())
    rows = [h for h in state["log_history"] if "odc/microbatches_min" in h]
    return [[int(h["odc/microbatches_min"]), int(h["odc/microbatches_max"])] for h in rows]


def _peak_memory_per_step(out: Path) -> list[float | None]:
    """The largest rank's peak memory (MiB) logged at each step: torch's allocator peak on a GPU, RSS on CPU."""
    state = json.loads((out / "trainer_state.json").read_text())
    return [h.get("odc/peak_mem_mb_max") for h in state["log_history"] if "loss" in h]


def compare_updates(odc_out: Path, ref_out: Path) -> dict[str, Any]:
    """ODC's weight updates against the reference's: both runs' ``initial_params.pt`` and ``final_params.pt``.

    Returns ``same_start`` (identical initial weights), ``unmoved`` (tensors whose update is zero on either side),
    ``update_rel`` (norm of the difference of the two updates over the norm of the reference's update, over every
    tensor: what the CPU parity tests bound) and ``update_max_rel_per_tensor`` (the same per tensor, the largest;
    reported: a tensor with a tiny update, e.g. a norm's weight, shows fp32 rounding of the weight itself there).
    """
    import torch

    def load(out: Path, name: str) -> dict[str, torch.Tensor]:
        return {k: v.double() for k, v in torch.load(out / name).items()}

    start, ref_start = load(odc_out, "initial_params.pt"), load(ref_out, "initial_params.pt")
    final, ref_final = load(odc_out, "final_params.pt"), load(ref_out, "final_params.pt")
    if not start.keys() == ref_start.keys() == final.keys() == ref_final.keys():
        return {"same_start": False, "unmoved": [], "update_rel": math.inf, "update_max_rel_per_tensor": math.inf}
    update = {k: final[k] - start[k] for k in final}
    ref_update = {k: ref_final[k] - ref_start[k] for k in ref_final}
    unmoved = sorted(k for k in update if not update[k].any() or not ref_update[k].any())
    diff = {k: float((update[k] - ref_update[k]).norm()) for k in update}
    norm = {k: float(ref_update[k].norm()) for k in ref_update}
    total = math.sqrt(sum(n * n for n in norm.values()))
    return {
        "same_start": all(torch.equal(start[k], ref_start[k]) for k in start),
        "unmoved": unmoved,
        "update_rel": math.sqrt(sum(d * d for d in diff.values())) / total if total else math.inf,
        "update_max_rel_per_tensor": max((diff[k] / norm[k] if norm[k] else math.inf) for k in diff),
    }


def _reports(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("odc_run_rank*.json"))]


def _shm_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("odc_")} if os.path.isdir("/dev/shm") else set()


def _failed(name: str, proc: subprocess.CompletedProcess, logs: list[str]) -> bool:
    if proc.returncode == 0:
        return False
    logs.append(f"===== {name}: exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n")
    logs.append(proc.stderr[-12000:])
    return True


def _run_key(name: str, ranks: int, plan: str) -> str:
    """``sft_fp32`` (2 ranks, free plan), ``sft_fp32_8ranks``, ``sft_fp32_8ranks_dynamic``, ..."""
    return name + (f"_{ranks}ranks" if ranks != 2 else "") + (f"_{plan}" if plan != "free" else "")


def case_parity(trainer: str, device: str, precision: str, work: Path, logs: list[str], timeout: float) -> dict:
    """The ODC runs of ``{trainer}_{precision}`` (`RUNS`) and TRL's trainer in one process, all started at once (they
    are compared, not timed; at most 2 at once on CPU); one result per ODC run (`_run_key`)."""
    name = f"{trainer}_{precision}"
    samples = SAMPLES_PER_STEP.get(name, DEFAULT_SAMPLES_PER_STEP)
    args = [*COMMON, *ARGS[trainer], "--odc_samples_per_step", str(samples)]
    shm_before = _shm_files()
    ref_out = work / f"{name}_ref"
    ref_cmd = _reference_command(trainer, device, precision, samples, [*args, "--output_dir", str(ref_out)])
    starts = [("reference", ref_cmd, _env(device))]
    for ranks, plan in RUNS.get(name, ((2, "free"),)):
        key = _run_key(name, ranks, plan)
        extra, env = [], {"ODC_DUMP_PARAMS": "1"}
        if plan != "free":
            extra = ["--odc_plan", plan]
            env.update(ODC_TEST_CLAIMS_DIR=str(work / f"{key}_claims"), ODC_TEST_LATE_RANK=str(ranks - 1))
        cmd = _odc_command(trainer, device, precision, work, [*args, *extra, "--output_dir", work / key], ranks)
        starts.append((key, cmd, _odc_env(device, **env)))
    done = _run_at_once(starts, timeout, parallel=len(starts) if device == "cuda" else 2)
    ref, ref_s = done.pop("reference")
    ref_ok = not _failed(f"{name} reference", ref, logs)
    results = {}
    for (key, (odc, odc_s)), (ranks, plan) in zip(done.items(), RUNS.get(name, ((2, "free"),)), strict=True):
        result: dict[str, Any] = {
            "ranks": ranks,
            "plan": plan,
            "samples_per_step": samples,
            "odc_wall_s": round(odc_s, 1),
            "reference_wall_s": round(ref_s, 1),
            "checks": {},
        }
        results[key] = result
        checks = result["checks"]
        checks["ODC run finished"] = not _failed(f"{key} ODC", odc, logs)
        checks["reference run finished"] = ref_ok
        if checks["ODC run finished"] and ref_ok:
            _compare_runs(result, work / key, ref_out, device, precision, unequal=name in RUNS)
    # every run has ended: what any of them left in /dev/shm is left for good
    left = _shm_files() - shm_before
    for result in results.values():
        if len(result["checks"]) > 2:
            result["checks"]["nothing left in /dev/shm"] = not left
    return results


def _run_at_once(starts: list[tuple[str, list, dict]], timeout: float, parallel: int) -> dict[str, tuple]:
    """Run the ``(key, command, environment)`` jobs, ``parallel`` at a time in the given order; ``{key:
    (CompletedProcess, wall seconds)}``."""
    pending, running, done = list(starts), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            key, cmd, env = pending.pop(0)
            running[key] = Job(cmd, env, timeout)
        finished = [key for key, job in running.items() if job.proc.poll() is not None]
        for key in finished:
            job = running.pop(key)
            done[key] = (job.wait(), job.wall_s)
        if not finished:
            time.sleep(0.2)
            for key, job in list(running.items()):
                if time.monotonic() > job.deadline:  # wait() kills it at its timeout
                    done[key] = (running.pop(key).wait(), job.wall_s)
    return {key: done[key] for key, _, _ in starts}


def _compare_runs(
    result: dict, odc_out: Path, ref_out: Path, device: str, precision: str, unequal: bool = False
) -> None:
    """Fill ``result`` with an ODC run's figures and checks against the reference's; with ``unequal``, that the
    ranks ran different numbers of microbatches in every step (what `SAMPLES_PER_STEP` was chosen for)."""
    checks, ranks = result["checks"], result["ranks"]
    reports = _reports(odc_out)
    transport = "CudaTransport" if device == "cuda" else "ShmTransport"
    result["transports"] = [r.get("transport") for r in reports]
    checks[f"all {ranks} ranks used the {transport} transport"] = len(reports) == ranks and all(
        r.get("transport") == transport for r in reports
    )
    checks["one FSDP2 mesh for every fully_shard call"] = all(r.get("fsdp_meshes") == 1 for r in reports)
    losses, ref_losses = _losses(odc_out), _losses(ref_out)
    result["loss"], result["reference_loss"] = losses, ref_losses
    result["peak_mem_mb_per_step"] = _peak_memory_per_step(odc_out)
    # the fewest and the most microbatches a rank ran, per step
    counts = _microbatch_counts(odc_out)
    result["microbatches_min_max_per_step"] = counts
    if unequal:
        checks["ranks ran unequal numbers of microbatches in every step"] = bool(counts) and all(
            low < high for low, high in counts
        )
    if result["plan"] == "dynamic":
        # per step, every rank's claimed indices (run_example.py's ODC_TEST_CLAIMS_DIR); the queue holds one sample
        # per microbatch (fewer samples than 4 per rank: `planning.dynamic.min_queue_length`)
        claimed = [r.get("claimed", []) for r in reports]
        per_step = [[mine[step] for mine in claimed] for step in range(min(map(len, claimed), default=0))]
        result["claimed_per_rank"] = [[len(mine) for mine in step] for step in per_step]
        checks["dynamic plan: every microbatch claimed exactly once in every step"] = len(per_step) == 2 and all(
            sorted(i for mine in step for i in mine) == list(range(result["samples_per_step"])) for step in per_step
        )
        checks["the late rank claimed none: some rank ran no microbatch in every step"] = (
            bool(counts) and all(low == 0 for low, _ in counts) and all(not step[-1] for step in per_step)
        )
    loss_rel = max(
        (abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses, strict=False)), default=math.inf
    )
    updates = compare_updates(odc_out, ref_out)
    result["loss_max_rel"] = loss_rel
    result.update(updates)
    tolerance = FP32_TOLERANCE if precision == "fp32" else BF16_TOLERANCE
    result["tolerance"] = tolerance
    checks["same number of logged steps"] = len(losses) == len(ref_losses) == 2
    checks[f"per-step loss within {tolerance:g} of TRL's in one process"] = loss_rel <= tolerance
    checks["both runs start from the same weights"] = updates["same_start"]
    checks["training moved every weight tensor, in both runs"] = not updates["unmoved"]
    checks[f"weight updates within {tolerance:g} of TRL's in one process (relative to the update's norm)"] = (
        updates["update_rel"] <= tolerance
    )


def case_grpo(device: str, work: Path, logs: list[str], timeout: float) -> dict:
    out = work / "grpo_odc"
    precision = "bf16" if device == "cuda" else "fp32"
    # No checkpoint at the last step: it gathers the optimizer's and model's CUDA DTensors over the shared GPU's gloo
    # group, which crashes (`shared_gpu.py`); the final ``save_model`` gathers through CPU. As in the other cases.
    args = ["--max_steps", "3", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no"]
    args += ["--output_dir", str(out)]
    if device == "cpu":  # the dry run checks this driver, not the model: 32 tokens per completion, not the default 128
        args += ["--max_completion_length", "32"]
    shm_before = _shm_files()
    start = time.perf_counter()
    proc = _odc_run("grpo", device, precision, work, args, timeout, ODC_COUNT_DIST_CALLS="1")
    result: dict[str, Any] = {"wall_s": round(time.perf_counter() - start, 1), "checks": {}}
    checks = result["checks"]
    checks["GRPO run finished"] = not _failed("grpo ODC", proc, logs)
    if not checks["GRPO run finished"]:
        return result
    reports, losses = _reports(out), _losses(out)
    transport = "CudaTransport" if device == "cuda" else "ShmTransport"
    result["loss"], result["transports"] = losses, [r.get("transport") for r in reports]
    result["peak_mem_mb_per_step"] = _peak_memory_per_step(out)
    checks[f"both ranks used the {transport} transport"] = len(reports) == 2 and all(
        r.get("transport") == transport for r in reports
    )
    checks["3 logged steps with finite losses"] = len(losses) == 3 and all(math.isfinite(x) for x in losses)
    calls = [c for r in reports for c in r.get("microbatch_dist_calls", []) + r.get("generation_dist_calls", [])]
    checks["no torch.distributed call during generation or a microbatch"] = bool(calls) and all(c == {} for c in calls)
    checks["nothing left in /dev/shm"] = _shm_files() <= shm_before
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--cases", default=None, help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per training run")
    p.add_argument("--budget-s", type=float, default=None, help="seconds the speed case may take (default: no limit)")
    args = p.parse_args(argv)
    cases = args.cases.split(",") if args.cases else [c for c in CASES if args.device == "cuda" or c != "sft_bf16"]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # The runs' own files stay out of OUT: only the result files come back from a GPU machine.
    with tempfile.TemporaryDirectory(prefix="odc_gpu_trainer_") as tmp:
        return _main(args, cases, out, Path(tmp))


def _main(args: argparse.Namespace, cases: list[str], out: Path, work: Path) -> int:
    logs: list[str] = []
    results: dict[str, Any] = {"device": args.device, "python": sys.version.split()[0]}
    for case in cases:
        print(f"[gpu_trainer] {case} ...", flush=True)
        if case == "grpo":
            got = {case: case_grpo(args.device, work, logs, args.timeout)}
        elif case == "speed":
            from .trainer_speed import case_speed

            got = {case: case_speed(args.device, work, out, logs, args.budget_s)}
        else:
            trainer, precision = case.split("_")
            got = case_parity(trainer, args.device, precision, work, logs, args.timeout)
        results.update(got)
        for key, value in got.items():
            print(f"[gpu_trainer] {key}: {json.dumps(value, default=str)[:4000]}", flush=True)
    keys = [k for k, v in results.items() if isinstance(v, dict) and "checks" in v]
    failed = [f"{c}: {k}" for c in keys for k, ok in results[c]["checks"].items() if not ok]
    results["failed"] = failed
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    lines = [f"device {args.device}"]
    for c in keys:
        r = results[c]
        figures = {k: r[k] for k in SUMMARY_FIGURES if k in r}
        lines.append(f"{c}: {figures}")
        lines += [f"  [{'ok' if ok else 'FAIL'}] {k}" for k, ok in r["checks"].items()]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    (out / "logs.txt").write_text("\n".join(logs))
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
