"""GRPO with vLLM generation under ODC, at Trainer level: the GRPO example (``examples/grpo/train.py``, the script of
``odc-accelerate grpo``) with ``--use_vllm true --vllm_mode colocate`` under real ``accelerate launch``, 2 CPU
processes, the offline prompts and rewards, 3 steps; the offline GRPO model is the tiny Qwen2 with 2 heads of
head_dim 64.

* ``odc``: the example through `tests/helpers/loops/run_example.py` with the vLLM checks (``ODC_TEST_VLLM_CHECK=1``,
  `tests/helpers/loops/vllm_trainer_check.py`), the torch.distributed call counter and the parameter dumps, under a small
  token budget so that the ranks run different numbers of microbatches. Each rank owns one vLLM engine, refreshed
  before each step's generation by ODC's per-rank sync;
* ``single``: plain `trl.GRPOTrainer` on one process with ``use_vllm=True``, training on exactly the completions and
  vLLM log-probs the ODC run generated (`tests/helpers/loops/grpo_vllm_replay.py`): the ground truth, TRL's
  importance-sampling correction included.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from odc_accelerate.testing import shm_files_of
from tests.helpers.loops.vllm_trainer_check import LOGPROB_TOLERANCE
from tests.multiprocess.integration_utils import ROOT, RUN_EXAMPLE, base_env, check_ok, reports, run

TRAIN = ROOT / "examples" / "grpo" / "train.py"
CONFIG = ROOT / "examples" / "grpo" / "configs" / "odc_cpu.yaml"
REPLAY = ROOT / "tests" / "helpers" / "loops" / "grpo_vllm_replay.py"
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per engine
    "VLLM_LOGGING_LEVEL": "WARNING",
}
MAX_COMPLETION = 16


def _model_bytes() -> int:
    """The offline GRPO model's fp32 size: what each sync hands to vLLM."""
    from transformers import AutoModelForCausalLM

    from odc_accelerate.demo import tiny_qwen2_config
    from odc_accelerate.scripts.grpo import OFFLINE_SHAPE

    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(**OFFLINE_SHAPE), dtype=torch.float32)
    return sum(p.numel() * 4 for p in model.parameters())


MODEL_BYTES = _model_bytes()
COMMON = [
    "--use_vllm", "true", "--vllm_mode", "colocate",
    "--max_steps", "3", "--logging_steps", "1", "--max_completion_length", str(MAX_COMPLETION), "--num_generations", "2",
    "--learning_rate", "1e-3", "--bf16", "false", "--report_to", "none", "--save_strategy", "no",
]  # fmt: skip
WORLD = 2
PER_RANK = 4  # completions per rank and step: 2 prompts, 2 completions each


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_vllm")
    out = {"odc": root / "odc", "single": root / "single"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIG, "--main_process_port", "0"]
    procs = {
        "odc": run(
            [*launch, RUN_EXAMPLE, TRAIN, "--odc", "true", "--per_device_train_batch_size", str(PER_RANK)]
            # 120 tokens: 3 + 3, 2 + 2 and 2 + 3 microbatches on the offline prompts of seed 42 (prompt + 16 tokens)
            + ["--odc_max_tokens_per_microbatch", "120", *COMMON, "--output_dir", out["odc"]],
            env=base_env(ODC_TEST_VLLM_CHECK="1", ODC_COUNT_DIST_CALLS="1", ODC_DUMP_PARAMS="1", **ENV),
            timeout=900,
        )
    }
    if procs["odc"].returncode == 0:
        procs["single"] = run(
            [sys.executable, REPLAY, "--odc_run", out["odc"], "--per_device_train_batch_size", str(PER_RANK * WORLD)]
            + [*COMMON, "--output_dir", out["single"]],
            env=base_env(**ENV),
            timeout=600,
        )
    return {"out": out, "procs": procs}


@pytest.fixture(scope="module")
def peft_run(tmp_path_factory):
    """The same run with LoRA adapters (``--use_peft``), DoRA (``--use_dora``) and a trained copy of the LM head
    (``--lora_modules_to_save lm_head``), 2 steps, a learning rate at which the adapters change what the model
    generates: each sync loads the merged weights (the rescaled DoRA layers and the trained head)."""
    out = tmp_path_factory.mktemp("grpo_vllm_peft") / "odc"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIG, "--main_process_port", "0"]
    peft = ["--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8", "--max_steps", "2", "--learning_rate", "0.05"]
    peft += ["--use_dora", "true", "--lora_modules_to_save", "lm_head"]
    proc = run(
        [*launch, RUN_EXAMPLE, TRAIN, "--odc", "true", "--per_device_train_batch_size", str(PER_RANK)]
        + [*COMMON, *peft, "--output_dir", out],  # the later value of an option wins
        env=base_env(ODC_TEST_VLLM_CHECK="1", ODC_COUNT_DIST_CALLS="1", **ENV),
        timeout=900,
    )
    return {"out": out, "proc": proc}


def test_peft_adapters_sync_as_merged_weights(peft_run):
    check_ok(peft_run["proc"])
    steps = _steps(json.loads((peft_run["out"] / "trainer_state.json").read_text())["log_history"])
    assert [h["step"] for h in steps] == [1, 2] and all(math.isfinite(h["loss"]) for h in steps), steps
    ranks = reports(peft_run["out"], "vllm_check_rank")
    assert [r["rank"] for r in ranks] == list(range(WORLD))
    for r in ranks:
        where = f"rank {r['rank']}"
        assert r["sync_dist_calls"] == [{}] * 2 and r["generation_dist_calls"] == [{}] * 2, where
        for c in r["checks"]:
            # vLLM's log-probabilities of every prompt position and its greedy tokens equal HF's on PEFT's own merge
            # of the trained adapters (gathered with DTensor)
            assert c["logprob_max_diff"] < LOGPROB_TOLERANCE, f"{where}, sync before step {c['step'] + 1}: {c}"
            assert c["vllm"] == c["hf"], f"{where}, sync before step {c['step'] + 1}: {c}"
        assert r["checks"][1]["before"] != r["checks"][1]["vllm"], f"{where}: the trained adapters changed nothing"
        assert r["checks"][1]["stale_logprob_max_diff"] > 10 * LOGPROB_TOLERANCE, r["checks"][1]
        for s in r["syncs"]:
            # the base model's 27 tensors under its own names (no adapter tensor reaches the engine)
            assert s["units"] == 4 and s["parameters"] == 27 and s["bytes"] == MODEL_BYTES, s
            assert s["loaded"] > 0, s  # every engine parameter loaded (the sync raises otherwise)
        assert r["shutdown"]["process_group_kept"] and r["shutdown"]["engine_core_shut_down"], r["shutdown"]
    assert shm_files_of([r["pid"] for r in ranks]) == []


def _steps(history: list[dict]) -> list[dict]:
    return [h for h in history if "loss" in h]


def _checks(runs) -> list[dict]:
    check_ok(runs["procs"]["odc"])
    ranks = reports(runs["out"]["odc"], "vllm_check_rank")
    assert [r["rank"] for r in ranks] == list(range(WORLD))
    return ranks


def test_trains_with_odc_and_a_vllm_engine_per_rank(runs):
    proc = runs["procs"]["odc"]
    check_ok(proc)
    # vLLM's tear-down at exit would fail on a destroyed process group had the engine not been shut down first
    assert "Invalid process group" not in proc.stderr, proc.stderr[-4000:]
    state = json.loads((runs["out"]["odc"] / "trainer_state.json").read_text())
    steps = _steps(state["log_history"])
    assert [h["step"] for h in steps] == [1, 2, 3]
    for h in steps:
        assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]), h
        # TRL's importance-sampling correction on vLLM's log-probs ran (sequence_mask, TRL's default)
        assert "sampling/importance_sampling_ratio/mean" in h, sorted(h)
        assert 0 < h["odc/generation_s_min"] <= h["odc/busy_s_max"] + 1e-3, h
    for r in reports(runs["out"]["odc"], "odc_run_rank"):
        assert r["engine"] == "ODCEngine"
        assert r["microbatch_dist_calls"] and all(c == {} for c in r["microbatch_dist_calls"])


def test_every_sync_and_generation_makes_no_collective(runs):
    for r in _checks(runs):
        assert r["sync_dist_calls"] == [{}] * 3, r["sync_dist_calls"]
        assert r["generation_dist_calls"] == [{}] * 3, r["generation_dist_calls"]
        assert [len(call["completion_ids"]) for call in r["rollouts"]] == [PER_RANK] * 3


def test_completions_stop_at_their_prompts_target_lengths(runs):
    # The example's offline rollout under --use_vllm: vLLM samples each completion and ends it at its prompt's real
    # continuation length (a per-prompt max_tokens), or earlier where it samples EOS.
    from odc_accelerate.demo import load_offline_tokenizer, offline_grpo_dataset

    tokenizer = load_offline_tokenizer()
    data = offline_grpo_dataset(tokenizer=tokenizer)
    prompts = tokenizer(text=list(data["prompt"]))["input_ids"]
    target_of = {tuple(ids): t for ids, t in zip(prompts, data["target_length"], strict=True)}
    below_cap = 0
    for r in _checks(runs):
        for call in r["rollouts"]:
            for prompt, completion in zip(call["prompt_ids"], call["completion_ids"], strict=True):
                target = target_of[tuple(prompt)]
                want = min(target, MAX_COMPLETION)
                if completion[-1] == tokenizer.eos_token_id:
                    assert len(completion) <= want, (len(completion), target)
                else:
                    assert len(completion) == want, (len(completion), target)
                below_cap += target < MAX_COMPLETION
    assert below_cap, "no prompt of these steps has a target below the cap: the check would not see the limit"


def test_after_every_sync_the_engine_holds_the_trained_weights(runs):
    for r in _checks(runs):
        where = f"rank {r['rank']}"
        assert [c["step"] for c in r["checks"]] == [0, 1, 2], where
        for c in r["checks"]:
            # vLLM's log-probabilities of every position of the check prompts, and its greedy tokens, equal HF's on
            # the trained model gathered with DTensor's collectives
            assert c["logprob_max_diff"] < LOGPROB_TOLERANCE, f"{where}, sync before step {c['step'] + 1}: {c}"
            assert c["vllm"] == c["hf"], f"{where}, sync before step {c['step'] + 1}: {c}"
        # a stale engine differs from the trained model by far more than the tolerance: the check can see it
        assert all(c["stale_logprob_max_diff"] > 10 * LOGPROB_TOLERANCE for c in r["checks"][1:]), r["checks"]
        # the first sync loads the initial weights again; each later one changes what the engine generates (so the
        # comparison above would catch a sync that did nothing)
        assert r["checks"][0]["before"] == r["checks"][0]["vllm"], where
        assert all(c["before"] != c["vllm"] for c in r["checks"][1:]), where
        for s in r["syncs"]:
            assert s["units"] == 4 and s["parameters"] == 27 and s["bytes"] == MODEL_BYTES, s
            assert s["loaded"] > 0, s  # every engine parameter loaded (the sync raises otherwise)


def test_engines_shut_down_keeping_the_process_group_and_nothing_left_in_shm(runs):
    ranks = _checks(runs)
    for r in ranks:
        assert r["shutdown"] == {"called": True, "process_group_kept": True, "engine_core_shut_down": True}, r
    assert shm_files_of([r["pid"] for r in ranks]) == []


def test_gradients_match_one_process_on_the_same_completions(runs):
    check_ok(runs["procs"]["odc"])
    check_ok(runs["procs"]["single"])
    odc_out, single_out = runs["out"]["odc"], runs["out"]["single"]
    odc = _steps(json.loads((odc_out / "trainer_state.json").read_text())["log_history"])
    single = json.loads((single_out / "losses.json").read_text())
    assert single["generate_calls"] == 3
    ref = _steps(single["log_history"])
    assert len(odc) == len(ref) == 3
    assert any(h["odc/microbatches_min"] != h["odc/microbatches_max"] for h in odc), "ranks ran equal microbatches"
    for mine, truth in zip(odc, ref, strict=True):
        assert mine["grad_norm"] == pytest.approx(truth["grad_norm"], rel=1e-5)
        # GRPO's loss is near 0 here (advantages sum to 0 per group, importance ratios near 1): compared absolutely
        assert mine["loss"] == pytest.approx(truth["loss"], abs=1e-5)
        for key in ("reward", "entropy", "sampling/importance_sampling_ratio/mean"):
            assert mine[key] == pytest.approx(truth[key], rel=1e-5), key
    a, b = torch.load(odc_out / "final_params.pt"), torch.load(single_out / "final_params.pt")
    init = torch.load(odc_out / "initial_params.pt")
    update = math.sqrt(sum(float(((b[k] - init[k]) ** 2).sum()) for k in b))
    diff = math.sqrt(sum(float(((a[k] - b[k]) ** 2).sum()) for k in b))
    # Adam moves every weight by about the learning rate whatever its gradient's size, so a weight whose gradient is
    # rounding noise may move either way: the norms are compared, not the largest difference
    assert update > 1e-2 and diff < 1e-3 * update, (diff, update)
