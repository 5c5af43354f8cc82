"""The ``dynamic`` plan end to end: the SFT and DPO examples under real `accelerate launch` (2 CPU processes), each
against TRL's own trainer in one process on the same samples per optimizer step.

* ``sft``: ``--odc_plan dynamic``, 5 samples per step (each truncated to the 128-token budget: a queue of 5
  microbatches); torch.distributed calls counted per microbatch. That a slower rank claims fewer is checked by
  `test_claims.py` with fixed delays; here the split depends on the machine's load.
* ``dpo``: ``--odc_plan dynamic``, 5 pairs per step (the pair count is read from the queue, nothing collated ahead).
* ``sft_single`` / ``dpo_single``: the references (`tests/helpers/loops/trl_reference.py`).
* ``dpo_moe`` / ``dpo_moe_single``: ``dpo`` on the tiny Qwen3-MoE with its router's auxiliary loss, against the
  reference weighting each microbatch's term by its share of the step's tokens, as ODC does.
* ``stream`` / ``stream_plain``: SFT on a streamed training set (``--dataset_streaming true``, 10 samples in
  2 steps of 5) under ``--odc_plan dynamic``, against one plain process reading the same stream in batches of 5.
* ``grpo`` / ``grpo_single``: fixed completions (`tests/helpers/loops/grpo_loop.py`) trained under ``--odc_plan dynamic``
  with a small token budget, against plain `trl.GRPOTrainer` in one process (loss type grpo, ``beta > 0``).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from integration_utils import (
    CONFIGS,
    DPO_METRICS,
    GRPO_GRAD_NORM_REL,
    MOE_AUX_COEF,
    ROOT,
    RUN_EXAMPLE,
    TRAIN,
    accelerate_launch,
    assert_dpo_metrics_match,
    background,
    base_env,
    check_ok,
    final_params,
    logged_steps,
    max_rel,
    model_args,
    reports,
    results,
    run,
)

from odc_accelerate.integrations.trainer.setup import DYNAMIC_POLICY_HINT

SFT_COMMON = [
    "--max_steps", "2", "--logging_steps", "1", "--report_to", "none", "--max_length", "128",
    "--odc_max_tokens_per_microbatch", "128", "--optim", "sgd", "--learning_rate", "0.5", "--seed", "0",
    "--dataloader_pin_memory", "false", "--save_strategy", "no", "--odc_samples_per_step", "5",
    # SGD with momentum, as the other SFT parity runs: the reference run is then the session's SFT one (conftest.py)
    "--optim_args", "momentum=0.9",
]  # fmt: skip
DPO_COMMON = [
    "--max_steps", "2", "--logging_steps", "1", "--report_to", "none", "--max_length", "64",
    "--odc_max_tokens_per_microbatch", "128", "--optim", "sgd", "--learning_rate", "0.2", "--seed", "0",
    "--dataloader_pin_memory", "false", "--save_strategy", "no", "--odc_samples_per_step", "5",
]  # fmt: skip
DYNAMIC = ["--odc", "true", "--odc_plan", "dynamic", "--odc_metrics", "per_rank"]
DUMP = {"ODC_DUMP_PARAMS": "1"}
GRPO_LOOP = ROOT / "tests" / "helpers" / "loops" / "grpo_loop.py"
GRPO = [
    "--loss_types", "grpo", "--beta", "0.1", "--bf16", "false", "--num_generations", "4",
    "--max_completion_length", "48", "--max_steps", "2", "--logging_steps", "1", "--report_to", "none",
    "--learning_rate", "1e-3", "--seed", "0", "--save_strategy", "no",
]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory, references, tiny_model):
    root = tmp_path_factory.mktemp("dynamic")
    from odc_accelerate.demo import offline_texts

    names = ("sft", "sft_single", "dpo", "dpo_single", "grpo", "grpo_single", "stream", "stream_plain")
    names += ("dpo_moe", "dpo_moe_single")
    out = {name: root / name for name in names}
    stream_data = root / "stream_data"
    stream_data.mkdir()
    with open(stream_data / "train.jsonl", "w") as f:
        for text in offline_texts(60, 4)[:10]:
            f.write(json.dumps({"text": text}) + "\n")
    stream = [*SFT_COMMON, "--dataset_name", str(stream_data), "--dataset_streaming", "true", "--max_length", "64"]
    procs = {
        "sft": background(
            accelerate_launch,
            CONFIGS / "odc_cpu.yaml",
            TRAIN,
            *DYNAMIC,
            *SFT_COMMON,
            "--output_dir",
            out["sft"],
            ODC_COUNT_DIST_CALLS="1",
            ODC_TRACE_DIR=str(out["sft"] / "trace"),
            **DUMP,
        ),
        "dpo": background(
            accelerate_launch,
            ROOT / "examples" / "dpo" / "configs" / "odc_cpu.yaml",
            ROOT / "examples" / "dpo" / "train.py",
            *DYNAMIC,
            *DPO_COMMON,
            "--output_dir",
            out["dpo"],
            ODC_COUNT_DIST_CALLS="1",
            **DUMP,
        ),
        "stream": background(
            accelerate_launch,
            CONFIGS / "odc_cpu.yaml",
            TRAIN,
            *DYNAMIC,
            *stream,
            "--output_dir",
            out["stream"],
            **DUMP,
        ),
        "stream_plain": background(
            run,
            [sys.executable, RUN_EXAMPLE, TRAIN, *_without_odc(stream), "--per_device_train_batch_size", "5"]
            + ["--output_dir", out["stream_plain"]],
            env=base_env(**DUMP),
        ),
        "grpo": background(
            accelerate_launch,
            ROOT / "examples" / "grpo" / "configs" / "odc_cpu.yaml",
            RUN_EXAMPLE,
            GRPO_LOOP,
            *DYNAMIC,
            "--odc_max_tokens_per_microbatch",
            "40",
            "--per_device_train_batch_size",
            "8",
            *GRPO,
            "--output_dir",
            out["grpo"],
            ODC_COUNT_DIST_CALLS="1",
        ),
        "grpo_single": background(
            run,
            [sys.executable, GRPO_LOOP, "--reference", "true", "--per_device_train_batch_size", "16", *GRPO]
            + ["--output_dir", out["grpo_single"]],
            env=base_env(),
        ),
    }
    procs["sft_single"], out["sft_single"] = references.start("sft", 5, *SFT_COMMON)
    procs["dpo_single"], out["dpo_single"] = references.start("dpo", 5, *DPO_COMMON)
    # The MoE with its router's auxiliary loss; the reference weights it as ODC does (the DPO module's, when both run)
    moe = model_args(tiny_model, "moe", aux=MOE_AUX_COEF)
    procs["dpo_moe"] = background(
        accelerate_launch,
        ROOT / "examples" / "dpo" / "configs" / "odc_cpu.yaml",
        ROOT / "examples" / "dpo" / "train.py",
        *DYNAMIC,
        *DPO_COMMON,
        *moe,
        "--output_dir",
        out["dpo_moe"],
        ODC_TRACE_DIR=str(out["dpo_moe"] / "trace"),
        **DUMP,
    )
    procs["dpo_moe_single"], out["dpo_moe_single"] = references.start("dpo", 5, *DPO_COMMON, *moe, "--aux_token_share")
    return {"out": out, "procs": results(procs)}


def _without_odc(args: list[str]) -> list[str]:
    """``args`` without the ``--odc*`` options and their values (for a plain run)."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg.startswith("--odc"):
            skip = True
        else:
            kept.append(arg)
    return kept


def _same_training(run, single, metrics=()):
    for a, b in zip(logged_steps(run), logged_steps(single), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)  # the exact mean over the global batch
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)  # fp32 summation order
        assert a["num_tokens"] == b["num_tokens"]
        if metrics:
            assert_dpo_metrics_match(a, b, keys=metrics)
    a, b = final_params(run), final_params(single)
    init = torch.load(single / "initial_params.pt")
    diff = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    update = sum(float((b[k] - init[k]).norm() ** 2) for k in b) ** 0.5
    assert update > 0 and diff / update <= 1e-4, (diff, update)
    assert max_rel(a, b) <= 1e-4


def test_sft_dynamic_matches_one_process(runs):
    for name in ("sft", "sft_single"):
        check_ok(runs["procs"][name])
    out = runs["out"]["sft"]
    _same_training(out, runs["out"]["sft_single"])
    # the banner names the plan, and (under the default memory policy) how to avoid its extra copies
    banner = "plan dynamic (each rank claims the step's next microbatch when it is free) (" + DYNAMIC_POLICY_HINT
    assert runs["procs"]["sft"].stderr.count(banner) == 1, runs["procs"]["sft"].stderr[-3000:]
    ranks = reports(out, "odc_run_rank")
    assert [r["odc_config"]["plan"] for r in ranks] == ["dynamic", "dynamic"]
    for r in ranks:
        assert r["microbatch_dist_calls"] and all(c == {} for c in r["microbatch_dist_calls"])
    traces = [
        [json.loads(line) for line in (out / "trace" / f"trace_rank{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    ]
    per_step = [[len(traces[r][s]["microbatches"]) for r in (0, 1)] for s in range(2)]
    # the ranks ran the step's 5 microbatches between them, each one sample truncated to the budget
    assert [sum(c) for c in per_step] == [5, 5], per_step
    assert all(mb["width"] == 128 for t in traces for step in t for mb in step["microbatches"])
    # the logged counts are the claimed ones
    history = logged_steps(out)
    assert [(h["odc/microbatches_min"], h["odc/microbatches_max"]) for h in history] == [
        (min(c), max(c)) for c in per_step
    ]


def test_dpo_dynamic_matches_one_process(runs):
    for name in ("dpo", "dpo_single"):
        check_ok(runs["procs"][name])
    _same_training(runs["out"]["dpo"], runs["out"]["dpo_single"], DPO_METRICS)
    for r in reports(runs["out"]["dpo"], "odc_run_rank"):
        assert r["odc_config"]["plan"] == "dynamic"
        assert r["microbatch_dist_calls"] and all(c == {} for c in r["microbatch_dist_calls"])


def test_dpo_dynamic_with_a_moe_router_aux_loss_matches_one_process(runs):
    """Each claimed microbatch's router term weighted by its share of the step's routed tokens, counted from the queue
    before the first claim: one process weighting it the same way on the same one-pair microbatches."""
    for name in ("dpo_moe", "dpo_moe_single"):
        check_ok(runs["procs"][name])
    out = runs["out"]["dpo_moe"]
    _same_training(out, runs["out"]["dpo_moe_single"], DPO_METRICS)
    assert all(h["aux_loss"] > 1.0 for h in logged_steps(out))
    traces = [(out / "trace" / f"trace_rank{r}.jsonl").read_text().splitlines() for r in (0, 1)]
    assert [sum(len(json.loads(t[s])["microbatches"]) for t in traces) for s in range(2)] == [5, 5]


def test_grpo_dynamic_matches_one_process(runs):
    for name in ("grpo", "grpo_single"):
        check_ok(runs["procs"][name])
    mine_dir, ref_dir = runs["out"]["grpo"], runs["out"]["grpo_single"]  # one loss type: no sub-folder
    mine = [h for h in json.loads((mine_dir / "losses.json").read_text())["log_history"] if "loss" in h]
    ref = [h for h in json.loads((ref_dir / "losses.json").read_text())["log_history"] if "loss" in h]
    assert len(mine) == len(ref) == 2
    for a, b in zip(mine, ref, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=GRPO_GRAD_NORM_REL)
        assert a["odc/microbatches_max"] >= 1
    a, b = torch.load(mine_dir / "final_params.pt"), torch.load(ref_dir / "final_params.pt")
    init = torch.load(ref_dir / "initial_params.pt")
    update = max(float((b[k] - init[k]).abs().max()) for k in b)
    diff = max(float((a[k] - b[k]).abs().max()) for k in b)
    assert update > 1e-4 and diff < 1e-2 * update, (diff, update)
    for r in reports(mine_dir, "odc_run_rank"):
        assert r["odc_config"]["plan"] == "dynamic"
        assert r["microbatch_dist_calls"] and all(c == {} for c in r["microbatch_dist_calls"])


def test_streamed_sft_dynamic_matches_one_plain_process(runs):
    for name in ("stream", "stream_plain"):
        check_ok(runs["procs"][name])
    out, plain = runs["out"]["stream"], runs["out"]["stream_plain"]
    assert reports(plain, "odc_run_rank")[0]["odc_config"]["plan"] is None  # the Trainer's own data path
    history = logged_steps(out)
    assert len(history) == 2
    # the stream's samples in batches of 5, read in order: the same samples and the same per-token mean loss
    for a, b in zip(history, logged_steps(plain), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["num_tokens"] == b["num_tokens"]
    assert max_rel(final_params(out), final_params(plain)) <= 1e-4
