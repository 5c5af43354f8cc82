"""Distillation with ODC under real launches, 2 CPU processes, offline assets.

Module-scoped runs (2 optimizer steps, fp32, ``beta 0.5``: the generalised JSD between forward and reverse KL):

* ``parity_odc``: fixed completions (`tests/helpers/loops/distillation_loop.py`, a seeded stand-in for the student's
  generation, some completions ending at EOS) trained with ODC on 2 ranks, 4 prompts per rank and step
  (``per_device_train_batch_size 2 x gradient_accumulation_steps 2``) under a small token budget, so that ranks run
  different numbers of microbatches; the teacher (twice as wide) on its gather-only engine; the torch.distributed
  calls counted in every training microbatch;
* ``parity_single``: plain `trl.DistillationTrainer`, one process, the same 8 completions per step as one microbatch;
* ``trl_script``: TRL's own, unmodified ``trl/scripts/distillation.py`` under ``odc-accelerate launch`` with the
  example's ``odc_cpu.yaml`` (``odc: true``), local student and teacher folders and a local JSON-lines dataset of
  prompts: the student generates on each rank (transformers' ``generate``), with its ``generate`` calls' and training
  microbatches' torch.distributed calls counted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from integration_utils import (
    GRPO_GRAD_NORM_REL,
    ROOT,
    RUN_EXAMPLE,
    accelerate_launch,
    background,
    base_env,
    check_ok,
    reports,
    results,
    run,
    shm_leftovers,
)

CONFIGS = ROOT / "examples" / "distillation" / "configs"
LOOP = ROOT / "tests" / "helpers" / "loops" / "distillation_loop.py"
COUNT = {"ODC_COUNT_DIST_CALLS": "1"}
COMMON = [
    "--bf16", "false", "--max_steps", "2", "--logging_steps", "1", "--report_to", "none", "--seed", "0",
    "--gradient_checkpointing", "false", "--learning_rate", "1e-3",
]  # fmt: skip
PARITY = [*COMMON, "--save_strategy", "no", "--beta", "0.5", "--max_completion_length", "16"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import trl

    from odc_accelerate.demo import load_offline_tokenizer, offline_grpo_dataset
    from odc_accelerate.testing.models import save_tiny_causal_lm

    root = tmp_path_factory.mktemp("distillation")
    out = {name: root / name for name in ("parity_odc", "parity_single", "trl_script")}
    shm_before = shm_leftovers()
    procs = {}
    procs["parity_odc"] = background(
        accelerate_launch,
        CONFIGS / "odc_cpu.yaml",
        RUN_EXAMPLE,
        LOOP,
        "--odc", "true", "--odc_max_tokens_per_microbatch", "56", "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "2", *PARITY, "--output_dir", out["parity_odc"],
        **COUNT,
    )  # fmt: skip
    reference = [sys.executable, LOOP, "--reference", "true", "--per_device_train_batch_size", "8", *PARITY]
    procs["parity_single"] = background(run, [*reference, "--output_dir", out["parity_single"]], env=base_env())
    # TRL's own script: local student and teacher folders (the same vocabulary) and prompts, ODC from the config file
    tokenizer = load_offline_tokenizer()
    student, teacher, data_dir = root / "student", root / "teacher", root / "data"
    save_tiny_causal_lm("untied", student, seed=0, hidden_size=32)
    save_tiny_causal_lm("untied", teacher, seed=1, hidden_size=64)
    for folder in (student, teacher):
        tokenizer.save_pretrained(folder)
    data_dir.mkdir()
    with open(data_dir / "train.jsonl", "w") as f:
        for prompt in offline_grpo_dataset(tokenizer=tokenizer)["prompt"][:16]:
            f.write(json.dumps({"prompt": prompt}) + "\n")
    script = Path(trl.__file__).parent / "scripts" / "distillation.py"
    launch = [sys.executable, "-m", "odc_accelerate.cli", "launch", "--config_file", CONFIGS / "odc_cpu.yaml"]
    args = [
        "--model_name_or_path",
        student,
        "--teacher_model_name_or_path",
        teacher,
        "--dataset_name",
        data_dir,
        "--dtype",
        "float32",
        "--per_device_train_batch_size",
        "2",
        "--max_completion_length",
        "8",
        *COMMON,
        "--output_dir",
        out["trl_script"],
    ]  # fmt: skip  (no --save_strategy no: TRL's script saves no trainer state itself, the final checkpoint holds it)
    env = {"HF_DATASETS_CACHE": str(root / "hf_datasets"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    procs["trl_script"] = background(
        run, [*launch, "--main_process_port", "0", RUN_EXAMPLE, script, *args], env=base_env(**env, **COUNT)
    )
    return {"out": out, "procs": results(procs), "shm_before": shm_before}


def _steps(path: Path) -> list[dict]:
    return [h for h in json.loads(path.read_text())["log_history"] if "loss" in h]


def test_unequal_microbatches_match_trls_trainer_in_one_process(runs):
    check_ok(runs["procs"]["parity_odc"])
    check_ok(runs["procs"]["parity_single"])
    odc_dir, ref_dir = runs["out"]["parity_odc"], runs["out"]["parity_single"]
    odc, ref = _steps(odc_dir / "losses.json"), _steps(ref_dir / "losses.json")
    assert len(odc) == len(ref) == 2
    assert any(h["odc/microbatches_min"] != h["odc/microbatches_max"] for h in odc), "ranks ran equal microbatches"
    for mine, truth in zip(odc, ref, strict=True):
        # the step's loss: TRL's per-token mean over every completion token of the global batch
        assert mine["loss"] == pytest.approx(truth["loss"], rel=1e-5)
        assert mine["grad_norm"] == pytest.approx(truth["grad_norm"], rel=GRPO_GRAD_NORM_REL)
        # the entropy: one ratio of global sums (not a mean of microbatch ratios)
        assert mine["entropy"] == pytest.approx(truth["entropy"], rel=1e-6)
        for key in ("num_tokens", "completions/mean_length", "completions/clipped_ratio"):
            assert mine[key] == pytest.approx(truth[key], rel=1e-9), key
    assert ref[1]["completions/clipped_ratio"] < 1.0  # some completions end at EOS (masked tails in the loss)
    a, b = torch.load(odc_dir / "final_params.pt"), torch.load(ref_dir / "final_params.pt")
    init = torch.load(ref_dir / "initial_params.pt")
    assert max(float((torch.load(odc_dir / "initial_params.pt")[k] - init[k]).abs().max()) for k in init) == 0.0
    update = max(float((b[k] - init[k]).abs().max()) for k in b)
    diff = max(float((a[k] - b[k]).abs().max()) for k in b)
    assert update > 1e-4 and diff < 3e-2 * update, (diff, update)
    ranks = reports(odc_dir, "odc_run_rank")
    assert len(ranks) == 2
    for r in ranks:
        assert r["engine"] == "ODCEngine"
        # the teacher is sharded and served by a gather-only engine
        assert r["reference_engine"] == "ODCEngine" and r["reference_frozen"] and r["reference_gathers"] > 0
        calls = r["microbatch_dist_calls"]
        # no collective inside any microbatch: no full_tensor() of a head, no teacher all-gather, no metric gather
        assert len(calls) >= 2 and all(c == {} for c in calls), calls


def test_trls_own_distillation_script_trains_with_odc_under_launch(runs):
    proc = runs["procs"]["trl_script"]
    check_ok(proc)
    out = runs["out"]["trl_script"]
    # TRL's script saves no trainer state itself: the Trainer's final checkpoint holds it
    steps = _steps(out / "checkpoint-2" / "trainer_state.json")
    assert [h["step"] for h in steps] == [1, 2]
    for h in steps:
        assert h["loss"] > 0 and h["grad_norm"] > 0, h
        assert h["odc/step_s"] > 0 and h["odc/generation_s_min"] > 0 and "entropy" in h, h  # the ODC trainer
    ranks = reports(out, "odc_run_rank")
    assert len(ranks) == 2
    for r in ranks:
        assert r["engine"] == "ODCEngine" and r["reference_engine"] == "ODCEngine"
        generation, microbatches = r["generation_dist_calls"], r["microbatch_dist_calls"]
        assert len(generation) >= 2 and all(c == {} for c in generation), generation
        assert len(microbatches) >= 2 and all(c == {} for c in microbatches), microbatches
    assert (out / "model.safetensors").exists()


def test_no_shared_memory_left(runs):
    assert shm_leftovers() <= runs["shm_before"]
