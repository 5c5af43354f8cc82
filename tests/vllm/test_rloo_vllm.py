"""RLOO with vLLM generation under ODC: the RLOO example (``examples/rloo/train.py``, the script of ``odc-accelerate
rloo``) with ``--use_vllm true --vllm_mode colocate`` under real ``accelerate launch``, 2 CPU processes, the offline
prompts and rewards, 2 steps, through `tests/helpers/loops/run_example.py` with the vLLM checks (``ODC_TEST_VLLM_CHECK=1``,
`tests/helpers/loops/vllm_trainer_check.py`) and the torch.distributed call counter, under a small token budget. Each rank
owns one vLLM engine, refreshed before each step's generation by ODC's per-rank sync, as for GRPO
(`tests/vllm/test_grpo_vllm.py`); RLOO asks vLLM for no log-probs and has no importance-sampling correction.
"""

from __future__ import annotations

import json
import math
import sys

import pytest

from odc_accelerate.testing import shm_files_of
from tests.helpers.loops.vllm_trainer_check import LOGPROB_TOLERANCE
from tests.multiprocess.integration_utils import ROOT, RUN_EXAMPLE, base_env, check_ok, reports, run

TRAIN = ROOT / "examples" / "rloo" / "train.py"
CONFIG = ROOT / "examples" / "rloo" / "configs" / "odc_cpu.yaml"
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
STEPS = 2
PER_RANK = 4  # completions per rank and step: 2 prompts, 2 completions each


@pytest.fixture(scope="module")
def odc_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("rloo_vllm") / "odc"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIG, "--main_process_port", "0"]
    args = [
        "--odc", "true", "--per_device_train_batch_size", str(PER_RANK), "--odc_max_tokens_per_microbatch", "120",
        "--use_vllm", "true", "--vllm_mode", "colocate", "--max_steps", str(STEPS), "--logging_steps", "1",
        "--max_completion_length", "16", "--num_generations", "2", "--learning_rate", "1e-3", "--bf16", "false",
        "--report_to", "none", "--save_strategy", "no", "--output_dir", out,
    ]  # fmt: skip
    proc = run(
        [*launch, RUN_EXAMPLE, TRAIN, *args],
        env=base_env(ODC_TEST_VLLM_CHECK="1", ODC_COUNT_DIST_CALLS="1", **ENV),
        timeout=900,
    )
    return {"proc": proc, "out": out}


def test_trains_with_odc_and_a_vllm_engine_per_rank(odc_run):
    proc = odc_run["proc"]
    check_ok(proc)
    assert "Invalid process group" not in proc.stderr, proc.stderr[-4000:]
    state = json.loads((odc_run["out"] / "trainer_state.json").read_text())
    steps = [h for h in state["log_history"] if "loss" in h]
    assert [h["step"] for h in steps] == list(range(1, STEPS + 1))
    for h in steps:
        assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) and "kl" in h, h
        assert 0 < h["odc/generation_s_min"] <= h["odc/busy_s_max"] + 1e-3, h
    for r in reports(odc_run["out"], "odc_run_rank"):
        assert r["engine"] == "ODCEngine" and r["reference_engine"] == "ODCEngine"
        assert r["microbatch_dist_calls"] and all(c == {} for c in r["microbatch_dist_calls"])


def test_every_sync_and_generation_makes_no_collective_and_loads_the_trained_weights(odc_run):
    check_ok(odc_run["proc"])
    ranks = reports(odc_run["out"], "vllm_check_rank")
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["sync_dist_calls"] == [{}] * STEPS and r["generation_dist_calls"] == [{}] * STEPS, r
        assert [len(call["completion_ids"]) for call in r["rollouts"]] == [PER_RANK] * STEPS
        for c in r["checks"]:
            assert c["logprob_max_diff"] < LOGPROB_TOLERANCE, c
        assert r["shutdown"] == {"called": True, "process_group_kept": True, "engine_core_shut_down": True}, r
    assert shm_files_of([r["pid"] for r in ranks]) == []
