"""RLOO with ODC under real `accelerate launch`, 2 CPU processes, offline assets.

Module-scoped runs:

* ``parity_odc``: fixed completions (`tests.helpers.loops.rloo_loop`, a seeded stand-in for generation, some completions
  unscorable) trained with ODC on 2 ranks for 3 steps under a small token budget, so ranks run different numbers of
  microbatches, ``beta=0.1`` (the KL-in-reward term; the reference model on its gather-only engine), with the
  torch.distributed calls counted in every training microbatch;
* ``parity_single``: plain `trl.RLOOTrainer`, one process, the same completions as one microbatch: the ground truth;
  both then train ``ITERATIONS`` (into ``OUT/iterations``): ``num_iterations=2`` and ``steps_per_generation=2``, 4
  steps on one generation batch (each slice twice, against TRL's old log-probs), TRL's shuffle before slicing fixed
  (``--fixed_slices``) so that the one process trains the same completions in each step as the 2 ranks;
* ``parity_odc_moe`` / ``parity_single_moe``: the same pair for one step on a Qwen3-MoE with its router's auxiliary
  loss, one completion per microbatch, the reference weighting each completion's term by its share of the step's
  tokens;
* ``example_odc``: the RLOO example (``--odc true``, TRL's own generation), 2 steps, with the torch.distributed calls
  counted in every ``generate`` call and training microbatch;
* ``trl_script``: TRL's own, unmodified ``trl/scripts/rloo.py`` under ``odc-accelerate launch`` with a config file
  written by ``odc-accelerate config --cpu --default``, a local model folder and a local JSON-lines dataset, 2 steps.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from integration_utils import (
    GRPO_GRAD_NORM_REL,
    MOE_AUX_COEF,
    ROOT,
    RUN_EXAMPLE,
    accelerate_launch,
    background,
    base_env,
    check_ok,
    model_args,
    reports,
    results,
    run,
    shm_leftovers,
)

CONFIGS = ROOT / "examples" / "rloo" / "configs"
TRAIN = ROOT / "examples" / "rloo" / "train.py"
LOOP = ROOT / "tests" / "helpers" / "loops" / "rloo_loop.py"
CLI = [sys.executable, "-m", "odc_accelerate.cli"]
COUNT = {"ODC_COUNT_DIST_CALLS": "1"}
PARITY = [
    "--beta", "0.1", "--bf16", "false", "--num_generations", "4", "--max_completion_length", "48",
    "--max_steps", "3", "--logging_steps", "1", "--report_to", "none", "--learning_rate", "1e-3", "--seed", "0",
    "--save_strategy", "no",
]  # fmt: skip


# The MoE parity run's one short step (the later values win)
MOE_SHORT = ["--max_steps", "1", "--max_completion_length", "24"]
ITERATIONS = "iterations:--num_iterations 2 --steps_per_generation 2 --max_steps 4 --fixed_slices true"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model):
    import trl

    from odc_accelerate.demo import load_offline_tokenizer, offline_grpo_dataset
    from odc_accelerate.testing.models import save_tiny_causal_lm

    root = tmp_path_factory.mktemp("rloo")
    names = ("parity_odc", "parity_single", "parity_odc_moe", "parity_single_moe", "example_odc", "trl_script")
    out = {name: root / name for name in names}
    shm_before = shm_leftovers()
    procs = {}
    procs["parity_odc"] = background(
        accelerate_launch,
        CONFIGS / "odc_cpu.yaml",
        RUN_EXAMPLE,
        LOOP,
        "--odc", "true", "--odc_max_tokens_per_microbatch", "40", "--per_device_train_batch_size", "8",
        *PARITY, "--extra_runs", ITERATIONS, "--output_dir", out["parity_odc"],
        **COUNT,
    )  # fmt: skip
    reference = [sys.executable, LOOP, "--reference", "true", "--per_device_train_batch_size", "16", *PARITY]
    reference += ["--extra_runs", ITERATIONS]
    procs["parity_single"] = background(run, [*reference, "--output_dir", out["parity_single"]], env=base_env())
    # The MoE with its router's auxiliary loss, one step: one completion per microbatch (each is at least 11 tokens)
    moe = [*PARITY, *model_args(tiny_model, "moe", hidden_size=32, aux=MOE_AUX_COEF), *MOE_SHORT]
    procs["parity_odc_moe"] = background(
        accelerate_launch,
        CONFIGS / "odc_cpu.yaml",
        RUN_EXAMPLE,
        LOOP,
        "--odc", "true", "--odc_max_tokens_per_microbatch", "20", "--per_device_train_batch_size", "8",
        *moe, "--output_dir", out["parity_odc_moe"],
    )  # fmt: skip
    reference = [sys.executable, LOOP, "--reference", "true", "--per_device_train_batch_size", "16", *moe]
    reference += ["--aux_token_share", "true", "--output_dir", out["parity_single_moe"]]
    procs["parity_single_moe"] = background(run, reference, env=base_env())
    procs["example_odc"] = background(
        accelerate_launch,
        CONFIGS / "odc_cpu.yaml",
        TRAIN,
        "--odc", "true", "--max_steps", "2", "--logging_steps", "1", "--max_completion_length", "16",
        "--output_dir", out["example_odc"],
        **COUNT,
    )  # fmt: skip
    # TRL's own script: a local model folder and dataset, ODC from the config file
    model_dir, data_dir = root / "model", root / "data"
    save_tiny_causal_lm("untied", model_dir, seed=0, hidden_size=32)
    tokenizer = load_offline_tokenizer()
    tokenizer.save_pretrained(model_dir)
    data_dir.mkdir()
    with open(data_dir / "train.jsonl", "w") as f:
        for prompt in offline_grpo_dataset(tokenizer=tokenizer)["prompt"][:32]:
            f.write(json.dumps({"prompt": prompt}) + "\n")
    cfg = root / "odc.yaml"
    check_ok(run([*CLI, "config", "--cpu", "--default", "--config_file", cfg], env=base_env()))
    script = Path(trl.__file__).parent / "scripts" / "rloo.py"
    args = [
        "--model_name_or_path", model_dir, "--dataset_name", data_dir,
        "--reward_funcs", "odc_accelerate.demo.ascii_text_reward",
        "--max_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", "4", "--num_generations", "2",
        "--max_completion_length", "16", "--learning_rate", "1e-3", "--bf16", "false", "--dtype", "float32",
        "--report_to", "none", "--output_dir", out["trl_script"],
    ]  # fmt: skip
    procs["trl_script"] = background(
        run, [*CLI, "launch", "--config_file", cfg, "--main_process_port", "0", RUN_EXAMPLE, script, *args]
    )
    return {"out": out, "procs": results(procs), "shm_before": shm_before}


def _steps(path: Path) -> list[dict]:
    return [h for h in json.loads(path.read_text())["log_history"] if "loss" in h]


def test_unequal_microbatches_match_one_process(runs):
    check_ok(runs["procs"]["parity_odc"])
    check_ok(runs["procs"]["parity_single"])
    odc_dir, ref_dir = runs["out"]["parity_odc"], runs["out"]["parity_single"]
    odc, ref = _steps(odc_dir / "losses.json"), _steps(ref_dir / "losses.json")
    assert len(odc) == len(ref) == 3
    assert any(h["odc/microbatches_min"] != h["odc/microbatches_max"] for h in odc), "ranks ran equal microbatches"
    for mine, truth in zip(odc, ref, strict=True):
        assert mine["loss"] == pytest.approx(truth["loss"], rel=1e-4, abs=1e-5)
        assert mine["grad_norm"] == pytest.approx(truth["grad_norm"], rel=GRPO_GRAD_NORM_REL)
        for key in ("entropy", "reward", "reward_std", "completions/mean_length", "clip_ratio/region_mean"):
            assert mine[key] == pytest.approx(truth[key], rel=1e-5, abs=1e-8), key
        # the mean of per-sequence sums of small old - ref differences (about 1e-3): fp32 noise of 2e-5 relative
        assert mine["kl"] == pytest.approx(truth["kl"], rel=1e-4, abs=1e-8)
    assert odc[-1]["kl"] > 0  # the KL-in-reward term is on from the second step
    a, b = torch.load(odc_dir / "final_params.pt"), torch.load(ref_dir / "final_params.pt")
    init = torch.load(ref_dir / "initial_params.pt")
    update = max(float((b[k] - init[k]).abs().max()) for k in b)
    diff = max(float((a[k] - b[k]).abs().max()) for k in b)
    # measured 1.5e-5 against a 2.0e-3 update: Adam's first steps magnify the fp32 noise of near-zero gradients
    assert update > 1e-4 and diff < 3e-2 * update, (diff, update)
    ranks = reports(odc_dir, "odc_run_rank")
    assert len(ranks) == 2
    for r in ranks:
        assert r["engine"] == "ODCEngine"
        assert r["reference_engine"] == "ODCEngine" and r["reference_gathers"] > 0
        calls = r["microbatch_dist_calls"]
        assert len(calls) >= 3 * 5 and all(c == {} for c in calls), calls
    assert shm_leftovers() <= runs["shm_before"], "shared memory left behind"


def test_moe_router_aux_loss_matches_one_process_of_the_token_share_definition(runs):
    """A Qwen3-MoE with its router's auxiliary loss: each microbatch's term weighted by its share of the step's
    routed tokens, against one process weighting each completion's own term by its share (one completion per
    microbatch on both sides)."""
    check_ok(runs["procs"]["parity_odc_moe"])
    check_ok(runs["procs"]["parity_single_moe"])
    odc_dir, ref_dir = runs["out"]["parity_odc_moe"], runs["out"]["parity_single_moe"]
    (mine,), (truth,) = _steps(odc_dir / "losses.json"), _steps(ref_dir / "losses.json")
    assert mine["odc/microbatches_min"] + mine["odc/microbatches_max"] == 16, mine
    assert mine["aux_loss"] > 1.0  # about 2 for a balanced top-2 router
    assert mine["aux_loss"] == pytest.approx(truth["aux_loss"], rel=1e-5)
    assert mine["loss"] == pytest.approx(truth["loss"], rel=1e-4, abs=1e-5)
    assert mine["grad_norm"] == pytest.approx(truth["grad_norm"], rel=GRPO_GRAD_NORM_REL)
    a, b = torch.load(odc_dir / "final_params.pt"), torch.load(ref_dir / "final_params.pt")
    init = torch.load(ref_dir / "initial_params.pt")
    # Relative to the whole update: Adam's first step turns the fp32 noise of near-zero expert gradients into up to
    # 3.3% of the learning rate in single entries (measured), while the weights differ by 2.3e-5 of the update.
    diff = sum(float((a[k] - b[k]).norm() ** 2) for k in b) ** 0.5
    update = sum(float((b[k] - init[k]).norm() ** 2) for k in b) ** 0.5
    assert update > 0 and diff / update <= 1e-4, (diff, update)


def test_several_updates_per_generation_batch_match_one_process(runs):
    """Each of the 4 steps of one generation batch trains its slice (slices 0, 1, 0, 1) against TRL's old log-probs:
    the ratios move away from 1 (clipped sequences) and every step is the one-process run's."""
    check_ok(runs["procs"]["parity_odc"])
    check_ok(runs["procs"]["parity_single"])
    odc_dir, ref_dir = runs["out"]["parity_odc"] / "iterations", runs["out"]["parity_single"] / "iterations"
    odc, ref = _steps(odc_dir / "losses.json"), _steps(ref_dir / "losses.json")
    assert len(odc) == len(ref) == 4
    assert ["reward" in h for h in odc] == ["reward" in h for h in ref] == [True, False, False, False]
    for mine, truth in zip(odc, ref, strict=True):
        assert mine["loss"] == pytest.approx(truth["loss"], rel=1e-4, abs=1e-5)
        assert mine["grad_norm"] == pytest.approx(truth["grad_norm"], rel=GRPO_GRAD_NORM_REL)
        for key in ("entropy", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"):
            assert mine[key] == pytest.approx(truth[key], rel=1e-5, abs=1e-8), key
    assert max(h["clip_ratio/region_mean"] for h in ref[2:]) > 0  # the second pass trains a moved policy
    a, b = torch.load(odc_dir / "final_params.pt"), torch.load(ref_dir / "final_params.pt")
    init = torch.load(ref_dir / "initial_params.pt")
    update = max(float((b[k] - init[k]).abs().max()) for k in b)
    diff = max(float((a[k] - b[k]).abs().max()) for k in b)
    assert update > 1e-4 and diff < 3e-2 * update, (diff, update)


def test_the_example_generates_and_trains_without_a_collective(runs):
    check_ok(runs["procs"]["example_odc"])
    state = json.loads((runs["out"]["example_odc"] / "trainer_state.json").read_text())
    steps = [h for h in state["log_history"] if "loss" in h]
    assert [h["step"] for h in steps] == [1, 2]
    for h in steps:
        for key in ("reward", "kl", "entropy", "clip_ratio/low_mean", "odc/tokens_per_s", "odc/generation_s_min"):
            assert key in h, (key, sorted(h))
        assert 0 < h["odc/generation_s_min"] and h["odc/generation_s_max"] <= h["odc/busy_s_max"] + 1e-3, h
    for r in reports(runs["out"]["example_odc"], "odc_run_rank"):
        generation, microbatches = r["generation_dist_calls"], r["microbatch_dist_calls"]
        assert len(generation) >= 2 and all(c == {} for c in generation), generation
        assert len(microbatches) >= 2 and all(c == {} for c in microbatches), microbatches
        assert r["reference_engine"] == "ODCEngine"  # TRL's default beta=0.05: the reference model is on


def test_trls_own_rloo_script_trains_with_odc(runs):
    proc = runs["procs"]["trl_script"]
    check_ok(proc)
    out = runs["out"]["trl_script"]
    # TRL's script saves no trainer state itself: the Trainer's final checkpoint holds it
    steps = [h for h in json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]]
    steps = [h for h in steps if "loss" in h]
    assert [h["step"] for h in steps] == [1, 2]
    for h in steps:
        assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]), h
        assert h["odc/step_s"] > 0 and "clip_ratio/region_mean" in h, h  # trained by the ODC RLOO trainer
    for r in reports(out, "odc_run_rank"):
        assert r["engine"] == "ODCEngine"
