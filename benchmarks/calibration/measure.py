"""One model's timings, in a process of its own: ``python -m benchmarks.calibration.measure JOB.json RESULT.json``.

The parent (`benchmarks.calibration.cli`) writes the job (model config, device, lengths, repeats, a wall-clock
deadline) and reads the result, which this process rewrites after every length so that a process killed at its
time limit still leaves what it measured. A fresh process per model gives every model an empty CUDA caching
allocator and no fragmentation left by the model before.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def _device_name(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU ({torch.get_num_threads()} threads)"


def _write(path: Path, result: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)  # atomic: the parent never reads half a file


def run_job(job: dict[str, Any], result_path: Path) -> dict[str, Any]:
    """Time forward + backward of one sequence per length for ``job["model"]``; see the module docstring."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

    name = job["model"]
    device = torch.device(job["device"])
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch sees no CUDA device here; use --device cpu for a dry run.")
        if device.index is None:  # torch.cuda.set_device refuses a device without an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    result: dict[str, Any] = {
        "model": name,
        "attn_implementation": job["attn_implementation"],
        "device": {"type": device.type, "name": _device_name(device)},
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "cuda": torch.version.cuda,
        },
        "points": [],
        "stopped": None,
    }
    deadline = job["deadline_unix"]
    log = f"[calibration] {name} ({job['attn_implementation']})"

    torch.manual_seed(job["seed"])
    fields = dict(job["config"])
    model_type = fields.pop("model_type", None)
    config = AutoConfig.for_model(model_type, **fields) if model_type else Qwen2Config(**fields)
    t0 = time.perf_counter()
    with device:  # random weights initialised on the device itself: no host copy of a 1.5B model
        model = AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, job["dtype"]), attn_implementation=job["attn_implementation"]
        )
    if any(p.device != device for p in model.parameters()):  # a transformers version that ignores the context
        model.to(device)
    model.config.use_cache = False
    model.train()
    if job["gradient_checkpointing"]:  # TRL's SFTConfig default (gradient_checkpointing=True)
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    result["num_parameters"] = sum(p.numel() for p in model.parameters())
    print(
        f"{log}: built {result['num_parameters'] / 1e6:.1f}M parameters on {result['device']['name']} in "
        f"{time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    _write(result_path, result)

    gen = torch.Generator(device=device).manual_seed(job["seed"])
    cuda = device.type == "cuda"

    def step(ids: torch.Tensor) -> float:
        model.zero_grad(set_to_none=True)  # outside the timed region: each step starts without gradients
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(input_ids=ids, labels=ids).loss.backward()  # causal LM loss over all tokens
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        return time.perf_counter() - t

    lengths = sorted(job["lengths"])
    warmup, repeats, min_repeats = job["warmup"], job["repeats"], job["min_repeats"]
    prev: tuple[int, float] | None = None
    for i, length in enumerate(lengths):
        remaining = deadline - time.time()
        # Time grows at least linearly with L: what the previous length took, scaled, is a lower bound.
        predicted = prev[1] * length / prev[0] if prev else 0.0
        if remaining <= 0 or predicted * (1 + min_repeats) > remaining:
            result["stopped"] = f"time budget: lengths {lengths[i:]} not measured"
            print(f"{log}: {result['stopped']}", flush=True)
            break
        oom = None
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            ids = torch.randint(0, config.vocab_size, (1, length), generator=gen, device=device)
            t_warm = [step(ids) for _ in range(max(1, warmup))]  # first calls: kernel selection, allocator growth
            # Repeats: the length's share of the remaining time (shares grow with L, as the times do).
            share = (deadline - time.time()) * length / sum(lengths[i:])
            n = min(repeats, int(share / t_warm[-1]))
            if n < min_repeats:
                n = min_repeats if (deadline - time.time()) > min_repeats * t_warm[-1] else 0
            if n == 0:
                result["stopped"] = f"time budget: lengths {lengths[i:]} not measured"
                print(f"{log}: {result['stopped']}", flush=True)
                break
            times = [step(ids) for _ in range(n)]
            peak = torch.cuda.max_memory_allocated(device) if cuda else None
            del ids
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            if not _is_oom(exc):
                raise
            oom = str(exc).splitlines()[0]
        if oom is not None:  # handled outside the except block, so that the failed step's tensors can be freed
            model.zero_grad(set_to_none=True)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            result["stopped"] = f"out of memory at {length} tokens: lengths {lengths[i:]} not measured ({oom})"
            print(f"{log}: {result['stopped']}", flush=True)
            break
        median = statistics.median(times)
        result["points"].append(
            {"length": length, "median_s": median, "times_s": times, "warmup_s": t_warm, "peak_memory_bytes": peak}
        )
        prev = (length, median)
        _write(result_path, result)
        mem = f", peak {peak / 2**30:.2f} GiB" if peak is not None else ""
        print(
            f"{log}: L={length:6d}  median {median * 1e3:9.2f} ms over {n} repeats{mem}; "
            f"{max(0.0, deadline - time.time()):.0f} s of its budget left",
            flush=True,
        )
    _write(result_path, result)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m benchmarks.calibration.measure JOB.json RESULT.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    if job.get("threads"):
        import torch

        torch.set_num_threads(int(job["threads"]))
    run_job(job, Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
