"""The rank function of the vLLM weight-sync test (tests/vllm): a tiny Qwen2 trained with ODC on 2 gloo ranks, each rank
with its own in-process vLLM engine refreshed by `odc_accelerate.integrations.vllm.sync_vllm_weights`.

vLLM is imported inside the function only: this module imports where vLLM is not installed.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers.infra.dist_counter import count_dist_calls

#: What every rank sets before its process group exists (`odc_accelerate.testing.launch(env=...)`).
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the rank's own process
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per engine
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}


def run_engine_script(script: str, *args: object) -> Any:
    """Run ``script`` (Python source) in a fresh interpreter with ``args`` as its ``sys.argv[1:]``, one in-process
    vLLM engine per process (`VLLM_ENV`), the repository on its path; return its last line of output, read as JSON."""
    import json
    import subprocess
    import sys

    from tests.multiprocess.integration_utils import ROOT

    env = {**os.environ, **VLLM_ENV, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: The tiny Qwen2 of the test: head_dim 128 / 2 = 64 (vLLM's CPU attention refuses 16), Qwen's vocabulary.
MODEL_SHAPE = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}


def tiny_model_and_tokenizer(seed: int = 0, tied: bool = False) -> tuple[Any, Any]:
    """The test's tiny Qwen2 (float32, sdpa, random init from ``seed``) and the offline tokenizer; with ``tied``, its
    LM head is the input embedding (``tie_word_embeddings``, as Qwen2.5 0.5B-3B)."""
    from transformers import AutoModelForCausalLM, set_seed

    from odc_accelerate.demo import load_offline_tokenizer, tiny_qwen2_config

    set_seed(seed)
    config = tiny_qwen2_config(**MODEL_SHAPE)
    config.tie_word_embeddings = tied
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model, load_offline_tokenizer()


def prompts_of(rank: int) -> list[str]:
    """Each rank's own prompts (a different number per rank): the openings of the offline texts."""
    from odc_accelerate.demo import offline_texts

    openings = [" ".join(text.split()[:8]) for text in offline_texts()[:5]]
    return openings[:2] if rank == 0 else openings[2:]


def _hf_greedy(model: Any, tokenizer: Any, prompts: list[str], max_tokens: int) -> list[list[int]]:
    out = []
    for prompt in prompts:
        enc = tokenizer(prompt, return_tensors="pt")
        ids = model.generate(
            **enc,
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id,
        )
        out.append(ids[0, enc.input_ids.shape[1] :].tolist())
    return out


def train_sync_generate(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Shard the model saved at ``spec["path"]`` with FSDP2 + ODC, start this rank's vLLM engine from the same copy,
    take one AdamW step through the engine (rank 0 runs 2 microbatches, rank 1 one), sync the engine and generate
    greedily from this rank's prompts, all inside a torch.distributed call counter; then gather the trained model with
    DTensor collectives (outside the counter) and generate the same prompts with HF.

    Returns the token ids of vLLM before and after the sync and of HF, the largest difference between vLLM's and HF's
    log-probabilities of every position of the check prompts before the step, after the sync, and between the stale
    engine and the trained model, the calls counted, the sync's figures, whether ODC's full parameters equal DTensor's
    gather bit for bit, and the state after shutting the engine down.
    """
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from odc_accelerate.demo import offline_texts
    from odc_accelerate.engine import ODCEngine
    from odc_accelerate.integrations.vllm import iter_full_parameters, shutdown_vllm, sync_vllm_weights
    from odc_accelerate.testing.models import world_mesh
    from tests.helpers.loops.vllm_trainer_check import hf_prompt_logprobs, max_logprob_difference, vllm_prompt_logprobs

    path, max_tokens = spec["path"], spec.get("max_tokens", 16)
    (spec["pid_dir"] / f"rank{rank}.pid").write_text(str(os.getpid()))
    out: dict[str, Any] = {}

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model_copy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    mesh = world_mesh("cpu")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = ODCEngine(model, timeout=120.0)

    # Collective: an engine created after init_process_group joins the job's group (docs/vllm.md).
    start = time.perf_counter()
    llm = LLM(path, dtype="float32", max_model_len=256, enforce_eager=True, seed=0, max_num_seqs=8)
    out["engine_start_s"] = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = prompts_of(rank)
    out["vllm_initial"] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    check_prompts = [tokenizer(" ".join(t.split()[:24]))["input_ids"] for t in offline_texts()[:3]]
    initial = vllm_prompt_logprobs(llm, check_prompts)
    out["logprobs_initial"] = max_logprob_difference(initial, hf_prompt_logprobs(model_copy, check_prompts))

    # One optimizer step through the engine; the ranks run different numbers of microbatches.
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.get("lr", 1e-2))
    texts = offline_texts()[10:13]
    mine = texts[:2] if rank == 0 else texts[2:]
    for text in mine:
        ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=64).input_ids
        model(input_ids=ids, labels=ids).loss.backward()
    engine.pre_optimizer_step()
    try:  # inside the optimizer step the published shards are about to change: refused
        next(iter_full_parameters(engine))
        out["inside_step_error"] = ""
    except RuntimeError as err:
        out["inside_step_error"] = str(err)
    optimizer.step()
    optimizer.zero_grad()
    engine.post_optimizer_step()

    # ``count=False``: the same, timed without the counter (whose dispatch mode sees every op, and slows them).
    counter = count_dist_calls() if spec.get("count", True) else contextlib.nullcontext({})
    with counter as calls:
        start = time.perf_counter()
        stats = sync_vllm_weights(llm, engine)
        out["sync_s"] = time.perf_counter() - start
        start = time.perf_counter()
        generated = llm.generate(prompts, params, use_tqdm=False)
        out["generate_s"] = time.perf_counter() - start
    out["calls"] = dict(calls)
    out["vllm"] = [list(o.outputs[0].token_ids) for o in generated]
    out["sync"] = vars(stats)

    # The reference: the trained model gathered with DTensor's own collectives, generated with HF.
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    out["odc_equals_gather"] = all(torch.equal(full[name], t) for name, t in iter_full_parameters(engine))
    out["odc_names"] = sorted(name for name, _ in iter_full_parameters(engine)) == sorted(full)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(full[name])
    out["hf"] = _hf_greedy(reference, tokenizer, prompts, max_tokens)
    trained = hf_prompt_logprobs(reference, check_prompts)
    out["logprobs_synced"] = max_logprob_difference(vllm_prompt_logprobs(llm, check_prompts), trained)
    out["logprobs_stale"] = max_logprob_difference(initial, trained)
    out["full_names"] = len(full)

    shutdown_vllm(llm)
    out["dist_after_shutdown"] = dist.is_initialized()
    engine.close()
    dist.barrier()  # the job's process group still works after the engine's tear-down
    return out


def checkpoint_weights_after_a_step(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Shard the tiny model of ``spec["kind"]`` (`odc_accelerate.testing.models.tiny_causal_lm_config`) with FSDP2 +
    ODC, take one SGD step (rank 0 two microbatches, rank 1 one), then read its weights through ODC as a checkpoint
    stores them (`iter_checkpoint_weights`) and, outside it, every parameter with DTensor's own gather."""
    from transformers import AutoModelForCausalLM, set_seed

    from odc_accelerate.integrations.vllm import VLLMSyncStats, iter_checkpoint_weights
    from odc_accelerate.testing.models import tiny_causal_lm_config

    from .peft_workers import sharded_sgd_step

    set_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_causal_lm_config(spec["kind"], hidden_size=32), dtype=torch.float32)
    engine = sharded_sgd_step(rank, model, model.model.layers)
    stats = VLLMSyncStats()
    weights = dict(iter_checkpoint_weights(engine, stats))
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    engine.close()
    # numpy arrays travel by value (a torch tensor would travel as a shared-memory handle that dies with this rank)
    return {
        "weights": {k: v.numpy() for k, v in weights.items()},
        "full": {k: v.detach().numpy() for k, v in full.items()},
        "stats": vars(stats),
    }
