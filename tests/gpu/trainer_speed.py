"""The Trainer's speed against its limit: the GPU procedure's ``trainer:speed`` case
(``python -m tests.gpu.gpu_trainer --cases speed --out DIR [--budget-s SECONDS]``).

A Qwen2.5-0.5B-shaped model (built from its config with random weights: hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, tied embeddings; in bf16, no mixed precision) trains with the SFT example on the offline long-tailed
data, packed under a token budget (the free plan, padding-free), on the same steps and samples in every arm:

* ``odc2`` against ``limit2``: ODC with 2 ranks sharing the GPU against the benchmarks' zero-communication limit
  (`benchmarks.e2e`'s ``limit`` arm: 2 independent processes at once, no process group, each running the whole global
  step; a rank's share of a step is its step time / 2);
* ``odc1`` against ``limit1``: ODC with one rank against the same model in one process without FSDP2 or ODC: with one
  rank FSDP2 moves nothing, so the difference is what FSDP2's per-layer hooks, ODC's and the step's synchronisation
  cost by themselves.

The arms run interleaved (``odc2 limit2 odc1 limit1``, then again, up to 3 times) within the budget: every arm once,
then each pair again while its runs fit in what is left, the 2-rank pair first; a run's figure is the median of its
measured steps (after the warm-up steps), an arm's the median over its runs. The step
after the measured ones runs under `torch.profiler` (``run_example.py``'s ``ODC_BENCH_PROFILE_STEP``); where ODC's
median step is more than `PROFILE_OVER` above its reference's, the ops with the most self time in that step, of ODC's
run and of the reference's, are kept. Writes ``DIR/trainer_speed.json`` after every run: machine, versions, commit
(``ODC_GPU_COMMIT``, else git), settings, every run's steps, the medians and the ratios. Figures are printed and stored,
never checked: the checks are that every run finished and logged its measured steps.

On CPU (the dry run) the same arms run once each, whatever the time left (the budget is then only each run's timeout),
on a tiny model of the same family (2 layers, hidden 112, 14 heads, 2 KV heads, tied embeddings) for 3 steps (warm-up,
measured, profiled) of 4 samples of at most 64 tokens: that tests this driver, not speed. Its work is fixed by steps and
samples, so a loaded machine makes it slower, not shorter. The model keeps Qwen's 151,936-token vocabulary (the
tokenizer's ids): its head's log-probabilities and gradient, over the whole vocabulary in every microbatch, are most of
a CPU step, so the step has few microbatches (one sample each) of few tokens.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import gpu_trainer

ROOT = gpu_trainer.ROOT
SFT = ROOT / "examples" / "sft" / "train.py"
#: ODC more than this much over its reference keeps the profiled step's top ops of both
PROFILE_OVER = 0.05
ARMS = ("odc2", "limit2", "odc1", "limit1")
#: each ODC arm and its reference, run one after the other; in the order of what matters most when time runs short
PAIRS = (("odc2", "limit2"), ("odc1", "limit1"))
#: the 0.5B shape on a GPU; on CPU a tiny model of the same family
TINY = dict(hidden_size=112, intermediate_size=608, num_hidden_layers=2, num_attention_heads=14, num_key_value_heads=2)
SETTINGS = {
    # samples per optimizer step, truncation, token budget of a microbatch, warm-up / measured steps, most repeats
    "cuda": dict(samples_per_step=32, max_length=4096, budget=4096, warmup=2, measured=6, repeats=3),
    # on CPU a fixed amount of work: one run per arm, whatever the time left (``fixed_runs``), each of few tokens
    "cpu": dict(
        samples_per_step=4,
        max_length=64,
        budget=64,
        warmup=1,
        measured=1,
        repeats=1,
        fixed_runs=True,
        args=["--use_cpu", "true"],
    ),
}


def build_model(device: str, path: Path) -> dict[str, Any]:
    """Save the model (random weights, seed 0, bf16) with the offline tokenizer to ``path``; return its shape."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from benchmarks.calibration.configs import MODEL_CONFIGS
    from odc_accelerate.demo import load_offline_tokenizer, offline_bpe_ranks, offline_vocab_size

    kwargs = dict(MODEL_CONFIGS["qwen2.5-0.5b"])
    if device == "cpu":
        kwargs.update(TINY)
    # the tokenizer's ids must fit; with Qwen's whole vocabulary the model keeps its own (151936) size
    vocab = offline_vocab_size()
    kwargs["vocab_size"] = max(kwargs["vocab_size"], vocab) if device == "cuda" else vocab
    eos = offline_bpe_ranks()  # <|endoftext|>
    kwargs.update(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**kwargs), dtype=torch.bfloat16)
    model.save_pretrained(path)
    load_offline_tokenizer().save_pretrained(path)
    shape = {k: kwargs[k] for k in (*TINY, "vocab_size", "tie_word_embeddings")}
    shape["parameters"] = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return shape


def _args(settings: dict, model: Path, out: Path, steps: int) -> list[str]:
    # on CPU ``use_cpu`` makes one launched process a (1-process) distributed job, as it is on a GPU
    return [*settings.get("args", []),
        "--model_name_or_path", str(model), "--dtype", "bfloat16", "--attn_implementation", "sdpa",
        "--bf16", "false", "--max_steps", str(steps), "--logging_steps", "1", "--report_to", "none",
        "--save_strategy", "no", "--seed", "0", "--learning_rate", "1e-5", "--padding_free", "true",
        "--max_length", str(settings["max_length"]), "--odc_max_tokens_per_microbatch", str(settings["budget"]),
        "--odc_samples_per_step", str(settings["samples_per_step"]), "--odc_plan", "free",
        "--output_dir", str(out),
    ]  # fmt: skip


def _jobs(arm: str, device: str, settings: dict, model: Path, run_dir: Path) -> list[tuple[Path, list, dict]]:
    """``(output folder, command, environment)`` of each process of one run of ``arm``."""
    ranks = int(arm[-1])
    steps = settings["warmup"] + settings["measured"] + 1  # the last one profiled
    env = {"ODC_METRICS": "per_rank", "ODC_BENCH_PROFILE_STEP": str(steps), "ODC_BENCH_SKIP_SAVE": "1"}
    if arm.startswith("odc"):
        args = _args(settings, model, run_dir, steps)
        cmd = gpu_trainer._odc_command("sft", device, "no", run_dir, args, ranks)
        return [(run_dir, cmd, gpu_trainer._odc_env(device, **env))]
    jobs = []
    for process in range(ranks):  # the limit: independent processes at once, each the whole global step
        out = run_dir / f"p{process}"
        cmd = [sys.executable, gpu_trainer.RUN_EXAMPLE, SFT, *_args(settings, model, out, steps)]
        jobs.append((out, cmd, gpu_trainer._env(device, **env)))
    return jobs


def run_arm(arm: str, device: str, settings: dict, model: Path, run_dir: Path, timeout: float, logs: list) -> dict:
    """One run of ``arm``: its processes at once; per process the measured steps' figures and the profile."""
    from benchmarks.e2e.records import parse_log_history, summarize_run

    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    jobs = _jobs(arm, device, settings, model, run_dir)
    done = gpu_trainer._run_at_once(
        [(str(i), cmd, env) for i, (_, cmd, env) in enumerate(jobs)], timeout, parallel=len(jobs)
    )
    record: dict[str, Any] = {"arm": arm, "ok": True, "wall_s": round(max(s for _, s in done.values()), 1)}
    processes = []
    for i, (out, _, _) in enumerate(jobs):
        proc, _ = done[str(i)]
        if gpu_trainer._failed(f"speed {arm} {run_dir.name} process {i}", proc, logs):
            record["ok"] = False
            continue
        steps = parse_log_history(json.loads((out / "trainer_state.json").read_text())["log_history"])
        measured = steps[: settings["warmup"] + settings["measured"]]  # the profiled step is not measured
        try:
            summary = summarize_run(measured, settings["warmup"], share=1 if arm.startswith("odc") else int(arm[-1]))
        except ValueError as err:
            logs.append(f"===== speed {arm} {run_dir.name} process {i}: {err}\n")
            record["ok"] = False
            continue
        profile = out / "profile_rank0.json"
        processes.append(
            {
                "steps": steps,
                "summary": summary,
                "profile": json.loads(profile.read_text()) if profile.exists() else None,
            }
        )
    record["processes"] = processes
    if arm.startswith("odc"):
        record["transports"] = [r.get("transport") for r in gpu_trainer._reports(run_dir)]
    if record["ok"] and processes:
        # the limit's processes did the same work at once: a rank's share of the step, averaged over them
        record["step_s"] = statistics.fmean(p["summary"]["step_s_median"] for p in processes)
        record["tokens_per_s"] = statistics.fmean(p["summary"]["tokens_per_s"] for p in processes)
    return record


def machine(device: str) -> dict[str, Any]:
    """The machine, the versions and the package's commit."""
    import importlib.metadata as metadata

    import torch

    out: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device,
        "host_cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "commit": commit(),
    }
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
        if shutil.which("nvidia-smi"):
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
            )
            out["driver"] = smi.stdout.strip()
    versions = {}
    for name in ("torch", "triton", "transformers", "accelerate", "trl", "datasets", "odc_accelerate"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    out["versions"] = versions
    return out


def commit() -> str | None:
    """The package's commit: ``ODC_GPU_COMMIT`` (a GPU machine's copy of the checkout has no git history), else git's
    (with ``-dirty`` when tracked files differ from it)."""
    if os.environ.get("ODC_GPU_COMMIT"):
        return os.environ["ODC_GPU_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except OSError:
        return None


def summarize(result: dict) -> None:
    """Medians per arm, ratios, and the profiles where ODC is more than `PROFILE_OVER` over its reference."""
    runs = result["runs"]
    medians = {
        arm: statistics.median(r["step_s"] for r in runs[arm] if "step_s" in r)
        for arm in ARMS
        if any("step_s" in r for r in runs.get(arm, []))
    }
    result["median_step_s"] = medians
    result["ratios"] = ratios = {}
    result["profiles"] = profiles = {}
    for odc, ref in (("odc2", "limit2"), ("odc1", "limit1")):
        if odc not in medians or ref not in medians:
            continue
        ratio = ratios[f"{odc}_over_{ref}"] = medians[odc] / medians[ref]
        if ratio > 1 + PROFILE_OVER:
            for arm in (odc, ref):
                last = next((r for r in reversed(runs[arm]) if r.get("processes")), None)
                profile = last["processes"][0]["profile"] if last else None
                if profile is not None:
                    profiles[arm] = {k: profile[k] for k in ("step", "sorted_by", "top", "table")}


def case_speed(device: str, work: Path, out: Path, logs: list[str], budget_s: float | None) -> dict[str, Any]:
    start = time.monotonic()
    budget = budget_s if budget_s is not None else float("inf")
    settings = SETTINGS[device]
    model = work / "speed_model"
    result: dict[str, Any] = {"machine": machine(device)}
    result["model"] = {"shape": "qwen2.5-0.5b" if device == "cuda" else "tiny", **build_model(device, model)}
    result["settings"] = {**settings, "dtype": "bfloat16", "plan": "free", "padding_free": True, "arms": list(ARMS)}
    result["runs"] = runs = {arm: [] for arm in ARMS}
    result["checks"] = checks = {}
    path = out / "trainer_speed.json"
    pair_s: dict[tuple[str, str], float] = {}  # how long each pair's last runs took
    for repeat in range(settings["repeats"]):
        ran = False
        for pair in PAIRS:
            left = budget - (time.monotonic() - start)
            # the first round runs every arm; later rounds a pair whose runs fit in what is left. With fixed runs (CPU)
            # every arm runs whatever is left: the budget is each run's timeout, the session's cap the safety net.
            fits = not (repeat and left < 1.2 * pair_s.get(pair, 0.0)) and left >= 20
            if not (fits or settings.get("fixed_runs")):
                continue
            began = time.monotonic()
            for arm in pair:
                left = budget - (time.monotonic() - start)
                run_dir = work / "speed" / f"{arm}_rep{repeat}"
                record = run_arm(arm, device, settings, model, run_dir, max(left, 20.0), logs)
                record["repeat"] = repeat
                runs[arm].append(record)
                print(f"[speed] {arm} repeat {repeat}: {record.get('step_s', 'failed')} s/step", flush=True)
                summarize(result)
                path.write_text(json.dumps(result, indent=1, default=str))
            pair_s[pair] = time.monotonic() - began
            ran = True
        if not ran:
            break
    for arm in ARMS:
        checks[f"{arm}: every run finished and logged its measured steps"] = bool(runs[arm]) and all(
            r["ok"] for r in runs[arm]
        )
    transport = "CudaTransport" if device == "cuda" else "ShmTransport"
    for arm in ("odc2", "odc1"):
        checks[f"{arm}: every rank trained with ODC ({transport})"] = bool(runs[arm]) and all(
            r.get("transports") == [transport] * int(arm[-1]) for r in runs[arm]
        )
    summarize(result)
    result["repeats_run"] = {arm: len(r) for arm, r in runs.items()}
    path.write_text(json.dumps(result, indent=1, default=str))
    shutil.rmtree(model, ignore_errors=True)
    # what the procedure's summary shows of this case (the JSON holds the rest)
    return {
        "median_step_s": result["median_step_s"],
        "ratios": result["ratios"],
        "repeats_run": result["repeats_run"],
        "profiled": sorted(result["profiles"]),
        "checks": checks,
    }
