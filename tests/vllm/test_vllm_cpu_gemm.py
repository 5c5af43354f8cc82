"""TRL's own colocate weight sync on vLLM's CPU backend, without ODC: one process, one in-process engine, a tiny dense
model whose weights are changed by a known amount and loaded as TRL's ``VLLMGeneration.sync_weights`` loads them
(``model.load_weights([(name, tensor)])``, one parameter at a time).

vLLM 0.32's CPU GEMM dispatch packs each linear layer's weight after the first load (oneDNN wherever its build has
oneDNN, SGL's kernel on CPUs with AMX) and replaces ``layer.weight`` with an empty parameter without
``weight_loader``, so that per-parameter load fails there (the first test: where the weights are left in place, as on a
build without either path, the load must serve the changed model instead). With ``torch_linear_vllm`` (``ODC_BENCH_VLLM_TORCH_LINEAR=1``,
what the GRPO benchmark sets for every vLLM arm) vLLM keeps the weights and computes with
``torch.nn.functional.linear``, and the same load serves the changed model. ODC's own sync (vLLM's in-place reload,
`tests/vllm/test_vllm_sync.py`) works either way."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers.loops.vllm_trainer_check import LOGPROB_TOLERANCE
from tests.helpers.workers.vllm_workers import run_engine_script

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM

    from odc_accelerate.demo import load_offline_tokenizer, offline_texts
    from odc_accelerate.testing.models import save_tiny_causal_lm
    from tests.helpers.loops.run_example import torch_linear_vllm
    from tests.helpers.loops.vllm_trainer_check import hf_prompt_logprobs, max_logprob_difference, vllm_prompt_logprobs

    root, mode = sys.argv[1], sys.argv[2]
    if mode == "torch_linear":
        torch_linear_vllm()
    from vllm import LLM

    path = save_tiny_causal_lm("untied", root, seed=0, hidden_size=256)
    tokenizer = load_offline_tokenizer()
    prompts = [tokenizer(" ".join(t.split()[:24]))["input_ids"] for t in offline_texts()[:3]]
    llm = LLM(str(path), dtype="float32", max_model_len=256, enforce_eager=True, seed=0, max_num_seqs=8)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.01 * (2 * torch.rand(p.shape, generator=gen) - 1))
    engine_model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    got = {
        # whether vLLM's dispatch packed the linear weights away after loading (the engine's 2-D weights left empty)
        "packs": any(p.numel() == 0 for n, p in engine_model.named_parameters() if n.endswith("proj.weight")),
        "error": None,
    }
    try:
        for name, param in model.named_parameters():  # as TRL's sync_weights, one parameter per call
            engine_model.load_weights([(name, param.detach())])
        llm.reset_prefix_cache()
        got["difference"] = max_logprob_difference(vllm_prompt_logprobs(llm, prompts), hf_prompt_logprobs(model, prompts))
    except AttributeError as e:
        got["error"] = str(e)
    print(json.dumps(got))
    """
)


@pytest.mark.multiprocess
def test_trls_per_parameter_load_fails_where_vllms_cpu_dispatch_packs_the_linear_weights(tmp_path):
    got = run_engine_script(_SCRIPT, tmp_path / "plain", "plain")
    print(got)
    if not got["packs"]:
        # neither oneDNN nor SGL here: vLLM keeps the weights, and TRL's load serves the changed model
        assert got["error"] is None and got["difference"] < LOGPROB_TOLERANCE, got
        return
    assert got["error"] is not None and "weight_loader" in got["error"], got


@pytest.mark.multiprocess
def test_with_torch_linear_trls_per_parameter_load_serves_the_changed_model(tmp_path):
    got = run_engine_script(_SCRIPT, tmp_path / "torch_linear", "torch_linear")
    print(got)
    assert got["packs"] is False, got  # every linear weight kept: the switch took effect before the engine loaded
    assert got["error"] is None and got["difference"] < LOGPROB_TOLERANCE, got
