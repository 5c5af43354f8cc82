"""HSDP with ODC through the normal flow: the SFT, DPO and GRPO trainers on 2 replicas x 2 shards.

Each run is 4 CPU processes on 2 emulated hosts, started as users start a job on two machines: two ``accelerate
launch --num_machines 2 --machine_rank i --main_process_ip 127.0.0.1`` commands (``ODC_HOST_ID=node<i>``), with the
accelerate config's ``parallelism_config`` (``dp_replicate_size: 2``, ``dp_shard_size: 2``). Module-scoped runs:

* ``sft``: ``accelerate launch`` + ``--odc true``, 5 samples per step over 4 ranks (unequal microbatch counts);
* ``dpo``: ``odc-accelerate launch`` (ODC switched on by the config file's ``odc*`` keys), 5 pairs per step, the
  ``dynamic`` plan (``ODC_PLAN``): the ranks of both replicas claim the step's pairs from one queue, keeping
  parameters and gradients through the step (``ODC_MEMORY_POLICY=both``);
* ``grpo``: fixed completions (`tests/helpers/loops/grpo_loop.py`) under a small token budget;
* each one's reference: TRL's own trainer in one process on the same optimizer steps;
* ``loop``: a custom accelerate loop on ``Accelerator(fsdp_plugin=ODCPlugin())`` (`tests/helpers/loops/accelerate_loop.py`),
  ranks running 2, 1, 0 and 3 microbatches per step, against the same loop in one process.

A shard group spread over hosts is refused by the engine on every rank (`tests/multiprocess/test_engine_hsdp.py`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from integration_utils import (
    CONFIGS,
    GRPO_GRAD_NORM_REL,
    LOOP,
    ROOT,
    RUN_EXAMPLE,
    assert_dpo_metrics_match,
    background,
    base_env,
    check_ok,
    final_params,
    logged_steps,
    reports,
    results,
    run,
    shm_leftovers,
)

from odc_accelerate.testing import free_port

pytestmark = pytest.mark.filterwarnings("ignore")

HSDP_CONFIG = CONFIGS / "odc_hsdp_cpu.yaml"
SFT, DPO, GRPO_LOOP = (
    ROOT / "examples/sft/train.py",
    ROOT / "examples/dpo/train.py",
    ROOT / "tests/helpers/loops/grpo_loop.py",
)
COMMON = ["--max_steps", "2", "--logging_steps", "1", "--report_to", "none", "--seed", "0", "--save_strategy", "no"]
SFT_ARGS = [*COMMON, "--max_length", "128", "--odc_max_tokens_per_microbatch", "128", "--optim", "sgd"]
SFT_ARGS += ["--learning_rate", "0.5", "--dataloader_pin_memory", "false", "--odc_samples_per_step", "5"]
# SGD with momentum has an optimizer state: torch loads a FULL_STATE_DICT optimizer checkpoint only when the optimizer
# has one, and the resumed run reads it back
SFT_ARGS += ["--optim_args", "momentum=0.9"]
SAVE_EACH_STEP = ["--save_strategy", "steps", "--save_steps", "1"]  # after COMMON's "no": the later value wins
DPO_ARGS = [*COMMON, "--max_length", "64", "--odc_max_tokens_per_microbatch", "128", "--optim", "sgd"]
DPO_ARGS += ["--learning_rate", "0.2", "--dataloader_pin_memory", "false", "--odc_samples_per_step", "5"]
GRPO_ARGS = [*COMMON, "--loss_types", "dapo", "--beta", "0.1", "--bf16", "false", "--num_generations", "4"]
GRPO_ARGS += ["--max_completion_length", "48", "--learning_rate", "1e-3"]
RECORD = {"ODC_DUMP_PARAMS": "1", "ODC_COUNT_DIST_CALLS": "1"}


def machines(
    config: Path, script: Path, *args, launcher: str = "accelerate", wrap: bool = True, timeout: float = 600, **env
):
    """Start one job of 4 processes as 2 machines (``ODC_HOST_ID=node<i>``), ``script`` run through
    `tests/helpers/loops/run_example.py` if ``wrap``; return both commands' completed processes."""
    head = (
        [sys.executable, "-m", "accelerate.commands.launch"]
        if launcher == "accelerate"
        else [sys.executable, "-m", "odc_accelerate.launch", "launch"]
    )
    port = str(free_port())
    wrapper = [RUN_EXAMPLE] if wrap else []
    machine = ["--num_machines", "2", "--num_processes", "4", "--main_process_ip", "127.0.0.1"]
    machine += ["--main_process_port", port]
    procs = [
        subprocess.Popen(
            [str(c) for c in (*head, "--config_file", config, *machine, "--machine_rank", i, *wrapper, script, *args)],
            cwd=ROOT,
            env=base_env(ODC_HOST_ID=f"node{i}", **RECORD, **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


@pytest.fixture(scope="module")
def runs(tmp_path_factory, references):
    root = tmp_path_factory.mktemp("hsdp")
    shm_before = shm_leftovers()
    names = ("sft", "sft_ref", "sft_resumed", "dpo", "dpo_ref", "grpo", "grpo_ref", "loop", "loop_ref")
    out = {name: root / name for name in names}
    procs = {}
    sft = [HSDP_CONFIG, SFT, "--odc", "true", *SFT_ARGS, *SAVE_EACH_STEP]
    procs["sft"] = background(machines, *sft, "--output_dir", out["sft"], ODC_TRACE_DIR=str(out["sft"] / "t"))
    procs["sft_ref"], out["sft_ref"] = references.start("sft", 5, *SFT_ARGS)
    procs["dpo"] = background(
        machines,
        HSDP_CONFIG,
        DPO,
        *DPO_ARGS,
        "--output_dir",
        out["dpo"],
        launcher="odc",
        ODC_TRACE_DIR=str(out["dpo"] / "t"),
        ODC_PLAN="dynamic",  # every rank of both replicas claims from one queue per step
        ODC_MEMORY_POLICY="both",  # parameters gathered once, gradients reduced once per step
    )
    procs["dpo_ref"], out["dpo_ref"] = references.start("dpo", 5, *DPO_ARGS)
    grpo = [GRPO_LOOP, "--odc", "true", "--odc_max_tokens_per_microbatch", "40", "--per_device_train_batch_size", "4"]
    procs["grpo"] = background(machines, HSDP_CONFIG, *grpo, *GRPO_ARGS, "--output_dir", out["grpo"])
    grpo_ref = [sys.executable, GRPO_LOOP, "--reference", "true", "--per_device_train_batch_size", "16", *GRPO_ARGS]
    procs["grpo_ref"] = background(lambda: [run([*grpo_ref, "--output_dir", out["grpo_ref"]], env=base_env())])
    loop = ["--counts", "2,1,0,3", "--count-collectives"]
    procs["loop"] = background(machines, HSDP_CONFIG, LOOP, *loop, "--plugin", "odc", "--out", out["loop"], wrap=False)
    procs["loop_ref"] = background(lambda: [run([sys.executable, LOOP, *loop, "--single", "--out", out["loop_ref"]])])
    procs["sft"].result()  # the resumed run starts from its first checkpoint
    if (out["sft"] / "checkpoint-1").is_dir():
        resume = ["--resume_from_checkpoint", out["sft"] / "checkpoint-1", "--output_dir", out["sft_resumed"]]
        procs["sft_resumed"] = background(machines, *sft, *resume)
    return {"out": out, "procs": results(procs), "shm_before": shm_before}


def _check(runs, name: str) -> None:
    procs = runs["procs"][name]
    for proc in procs if isinstance(procs, list) else [procs]:  # a job of two machines, or one process
        check_ok(proc)


def _check_hsdp_ranks(out: Path, steps: int) -> None:
    """Every rank ran ODC on the 2 x 2 mesh: no collective in any microbatch, one all-reduce per bucket per step."""
    ranks = reports(out, "odc_run_rank")
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    for r in ranks:
        assert r["engine"] == "ODCEngine" and r["transport"] == "ShmTransport" and r["replicas"] == 2, r
        assert all(c == {} for c in r["microbatch_dist_calls"]), r["microbatch_dist_calls"]
        buckets = len(r["replicate_buckets"])
        assert buckets >= 1 and len(r["sync_dist_calls"]) == steps, r["sync_dist_calls"]
        for calls in r["sync_dist_calls"]:
            assert {k: v for k, v in calls.items() if k.startswith("api:")} == {"api:all_reduce": buckets}, calls
        assert r["engine_last_step"]["replicate_bytes"] > 0


def _microbatches_per_rank(trace: Path) -> list[list[int]]:
    """Microbatches each rank ran in each traced step."""
    return [
        [len(json.loads(line)["microbatches"]) for line in (trace / f"trace_rank{r}.jsonl").read_text().splitlines()]
        for r in range(4)
    ]


def _relative_diff(a: dict, b: dict, init: dict) -> tuple[float, float]:
    diff = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    update = sum(float((b[k] - init[k]).norm() ** 2) for k in b) ** 0.5
    return diff, update


def test_sft_hsdp_matches_trl_in_one_process(runs):
    _check(runs, "sft")
    _check(runs, "sft_ref")
    out, ref = runs["out"]["sft"], runs["out"]["sft_ref"]
    _check_hsdp_ranks(out, steps=2)
    counts = _microbatches_per_rank(out / "t")
    assert any(min(step) != max(step) for step in zip(*counts, strict=True)), counts
    for a, b in zip(logged_steps(out), logged_steps(ref), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)  # the mean over every token of the global batch
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["num_tokens"] == b["num_tokens"]
    diff, update = _relative_diff(final_params(out), final_params(ref), torch.load(ref / "initial_params.pt"))
    assert update > 0 and diff / update <= 1e-4, (diff, update)
    assert shm_leftovers() <= runs["shm_before"], "shared memory left behind"


def test_sft_hsdp_resumes_from_a_trainer_checkpoint(runs):
    # The Trainer's own save and resume_from_checkpoint on the 2-D mesh: resumed after step 1, step 2 lands on the
    # uninterrupted run's weights (up to the order in which peers' adds arrive).
    _check(runs, "sft")
    assert "sft_resumed" in runs["procs"], "the SFT run saved no checkpoint-1"
    _check(runs, "sft_resumed")
    out, resumed = runs["out"]["sft"], runs["out"]["sft_resumed"]
    last = logged_steps(resumed)[-1]  # the checkpoint's log history comes back with it
    assert last["step"] == 2 and last["loss"] == pytest.approx(logged_steps(out)[1]["loss"], rel=1e-5)
    _check_hsdp_ranks(resumed, steps=1)
    init = torch.load(out / "initial_params.pt")
    diff, update = _relative_diff(final_params(resumed), final_params(out), init)
    assert update > 0 and diff / update <= 1e-5, (diff, update)


def test_dpo_hsdp_dynamic_plan_from_config_keys_matches_trl_in_one_process(runs):
    _check(runs, "dpo")
    _check(runs, "dpo_ref")
    out, ref = runs["out"]["dpo"], runs["out"]["dpo_ref"]
    _check_hsdp_ranks(out, steps=2)
    for r in reports(out, "odc_run_rank"):
        assert r["odc_config"]["source"] == "env"  # the config file's odc keys, exported by odc-accelerate launch
        assert r["odc_config"]["plan"] == "dynamic" and r["odc_config"]["memory_policy"] == "both"
        assert r["reference_engine"] == "ODCEngine" and r["reference_gathers"] > 0
    counts = _microbatches_per_rank(out / "t")
    assert [sum(step) for step in zip(*counts, strict=True)] == [5, 5], counts  # each pair claimed once
    assert any(min(step) != max(step) for step in zip(*counts, strict=True)), counts
    for a, b in zip(logged_steps(out), logged_steps(ref), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert_dpo_metrics_match(a, b, keys=("rewards/margins",))
    diff, update = _relative_diff(final_params(out), final_params(ref), torch.load(ref / "initial_params.pt"))
    assert update > 0 and diff / update <= 1e-4, (diff, update)


def test_grpo_hsdp_matches_trl_in_one_process(runs):
    _check(runs, "grpo")
    _check(runs, "grpo_ref")
    out, ref = runs["out"]["grpo"], runs["out"]["grpo_ref"]  # one loss type: written to the output folder itself
    _check_hsdp_ranks(out, steps=2)
    mine = [h for h in json.loads((out / "losses.json").read_text())["log_history"] if "loss" in h]
    truth = [h for h in json.loads((ref / "losses.json").read_text())["log_history"] if "loss" in h]
    assert len(mine) == len(truth) == 2
    assert any(h["odc/microbatches_min"] != h["odc/microbatches_max"] for h in mine)
    for a, b in zip(mine, truth, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=GRPO_GRAD_NORM_REL)
    a, b = torch.load(out / "final_params.pt"), torch.load(ref / "final_params.pt")
    init = torch.load(ref / "initial_params.pt")
    update = max(float((b[k] - init[k]).abs().max()) for k in b)
    diff = max(float((a[k] - b[k]).abs().max()) for k in b)
    assert update > 1e-4 and diff < 1e-2 * update, (diff, update)


def test_odc_plugin_loop_with_a_rank_running_nothing_matches_one_process(runs):
    _check(runs, "loop")
    _check(runs, "loop_ref")
    ranks = reports(runs["out"]["loop"], "result_rank")
    ref = reports(runs["out"]["loop_ref"], "result_rank")[0]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    for r in ranks:
        assert r["plugin"] == "ODCPlugin" and r["engine"] == "ODCEngine" and r["replicas"] == 2, r["plugin"]
        assert r["mesh"] == ["dp_replicate", "dp_shard"]
        buckets = len(r["replicate_buckets"])
        for step in r["collectives"]:
            assert step["microbatches"] == {}, step
            assert {k: v for k, v in step["pre_optimizer_step"].items() if k.startswith("api:")} == {
                "api:all_reduce": buckets
            }, step
    # each rank logs its share of the global token mean (rank 2 ran nothing: 0); their sum is the one-process loss
    assert [r["losses"] for r in ranks][2] == [0.0, 0.0]
    np.testing.assert_allclose(np.sum([r["losses"] for r in ranks], axis=0), ref["losses"], rtol=1e-5)
    params = [{k: np.asarray(v, dtype=np.float64) for k, v in r["params"].items()} for r in (*ranks, ref)]
    # Over the whole model: peers' adds land in arrival order (fp32 rounding), which AdamW amplifies in entries whose
    # true gradient is zero (the key bias). Measured ~7e-7; a wrong weighting of the unequal microbatches moves the
    # weights by ~lr (1e-2).
    diff = sum(float(((params[0][k] - ref_k) ** 2).sum()) for k, ref_k in params[-1].items())
    norm = sum(float((ref_k**2).sum()) for ref_k in params[-1].values())
    assert (diff / norm) ** 0.5 <= 1e-5, (diff / norm) ** 0.5
    for mine in params[1:4]:  # every replica and shard holds the same model
        assert all(np.array_equal(mine[k], params[0][k]) for k in params[0])
