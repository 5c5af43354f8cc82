"""GRPO with ODC under real `accelerate launch`, 2 CPU processes, offline assets.

Module-scoped runs:

* ``example_odc``: the GRPO example exactly as its README runs it (``--odc true --max_steps 3``), with the
  torch.distributed calls counted during every ``generate`` call and every training microbatch.
* ``example_fsdp2``: the same example on plain FSDP2 (TRL's behaviour), one short step: the counter's negative
  control.
* ``parity_odc``: fixed completions (`tests.helpers.loops.grpo_loop`, a seeded stand-in for generation) trained
  with ODC on 2 ranks under a small token budget, so ranks run different numbers of microbatches; loss types grpo
  (a mean over sequences), bnpo (over the microbatch's tokens) and dapo (over the step's tokens), ``beta > 0`` (the
  reference model on its gather-only engine); then grpo again with ``beta=0``, the control of the gradient norm's
  tolerance (no KL term).
* ``parity_single``: plain `trl.GRPOTrainer`, one process, the same completions as one microbatch: the ground truth.
* ``parity_odc_tied`` / ``parity_single_tied``, ``parity_odc_moe`` / ``parity_single_moe``: the same pair, loss type
  grpo only, on a Llama 3.2-shaped model with tied embeddings and on a Qwen3-MoE (the session's `tiny_model`), the
  MoE with its router's auxiliary loss, one completion per microbatch, its reference weighting each completion's
  term by its share of the step's tokens (``--aux_token_share``);
  ``parity_odc_hybrid`` / ``parity_single_hybrid``: one step of it on a Qwen3.5-MoE hybrid (3 Gated DeltaNet layers,
  1 full attention), shorter completions.
* ``parity_odc`` / ``parity_single`` also train, after those, several updates per generation batch
  (`ITERATION_RUNS`): GSPO (``importance_sampling_level="sequence"``) with ``num_iterations=2`` and
  ``steps_per_generation=2`` (4 steps on one generation batch: each slice twice, TRL's old log-probs), and dapo with
  ``steps_per_generation=4`` over ``gradient_accumulation_steps=2`` (2 steps, each of 2 slices, the reference model
  on). TRL's shuffle before slicing is fixed (``--fixed_slices``) so that the one-process reference trains the same
  completions in each step as the 2 ranks.
* ``bad_entropy``: the example with an option ODC cannot make exact (``--entropy_coef``): refused before training.
"""

from __future__ import annotations

import json
import shlex
import sys

import pytest
import torch
from integration_utils import (
    GRPO_GRAD_NORM_REL,
    HYBRID,
    MODEL_KINDS,
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

CONFIGS = ROOT / "examples" / "grpo" / "configs"
TRAIN = ROOT / "examples" / "grpo" / "train.py"
LOOP = ROOT / "tests" / "helpers" / "loops" / "grpo_loop.py"
LOSS_TYPES = ("grpo", "bnpo", "dapo")
COUNT = {"ODC_COUNT_DIST_CALLS": "1"}
PARITY = [
    "--loss_types",
    ",".join(LOSS_TYPES),
    "--kl_free_loss_types",
    "grpo",
    "--beta",
    "0.1",
    "--bf16",
    "false",
    "--num_generations",
    "4",
    "--max_completion_length",
    "48",
    "--max_steps",
    "2",
    "--logging_steps",
    "1",
    "--report_to",
    "none",
    "--learning_rate",
    "1e-3",
    "--seed",
    "0",
    "--save_strategy",
    "no",
]


def _one_loss_type(args: list[str], loss_type: str) -> list[str]:
    """``args`` training ``loss_type`` alone: without the loop's ``--loss_types`` / ``--kl_free_loss_types``."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("--loss_types", "--kl_free_loss_types"):
            skip = True
        else:
            kept.append(arg)
    return [*kept, "--loss_type", loss_type]


# The parity runs of each model kind: the offline default's train every LOSS_TYPES (OUT/<type>), the others grpo alone;
# "ordered": the offline default's model under --odc_reduction ordered, grpo alone, against the default's reference.
PARITY_RUNS = [("untied", loss_type) for loss_type in LOSS_TYPES] + [(kind, "grpo") for kind in MODEL_KINDS[1:]]
PARITY_RUNS += [("ordered", "grpo"), (HYBRID, "grpo")]
# Several updates per generation batch, trained after the loss types in the offline default's parity runs (OUT/<name>):
# (ODC's arguments on 2 ranks, the one-process reference's; both slice in a fixed order, --fixed_slices). The dapo
# reference trains each step's 16 completions in one microbatch with steps_per_generation=2: TRL's normaliser
# (num_items / world x ga / spg) is then ODC's run's (ga=2, spg=4), and so is every logged metric.
GSPO_ITERATIONS = [
    "--loss_type", "grpo", "--importance_sampling_level", "sequence", "--beta", "0", "--num_iterations", "2",
    "--steps_per_generation", "2", "--max_steps", "4",
]  # fmt: skip
ITERATION_RUNS = {
    "gspo_iterations": (GSPO_ITERATIONS, GSPO_ITERATIONS),
    "dapo_slices": (
        ["--loss_type", "dapo", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
         "--steps_per_generation", "4"],
        ["--loss_type", "dapo", "--steps_per_generation", "2"],
    ),
}  # fmt: skip


def _extra_runs(which: int) -> list[str]:
    """The loop's arguments for `ITERATION_RUNS` (``which``: 0 for ODC's run, 1 for the reference's)."""
    spec = ";".join(
        f"{name}:{shlex.join([*args[which], '--fixed_slices', 'true'])}" for name, args in ITERATION_RUNS.items()
    )
    return ["--extra_runs", spec]


# The hybrid model's one step (the later values win): its linear-attention layers run transformers' slow fallback.
HYBRID_SHORT = ["--max_steps", "1", "--max_completion_length", "24"]


# The MoE trains with its router's auxiliary loss, under a budget that holds one completion per microbatch (every
# prompt and completion is at least 11 tokens): the reference weights each completion's own term by its token share.
MOE_BUDGET = "20"


def _aux(kind: str) -> float:
    return MOE_AUX_COEF if kind == "moe" else 0.0


def _parity_names(kind: str) -> tuple[str, str]:
    """The run names of the ODC run and of its one-process reference for ``kind``."""
    if kind == "untied":
        return "parity_odc", "parity_single"
    return f"parity_odc_{kind}", "parity_single" if kind == "ordered" else f"parity_single_{kind}"


def _parity_dirs(runs, kind: str, loss_type: str):
    """The output folders of the ODC run and of its one-process reference for ``kind`` and ``loss_type``."""
    odc, single = _parity_names(kind)
    if kind == "untied":
        return runs["out"][odc] / loss_type, runs["out"][single] / loss_type
    if kind == "ordered":
        return runs["out"][odc], runs["out"][single] / loss_type
    return runs["out"][odc], runs["out"][single]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("grpo")
    shm_before = shm_leftovers()
    names = ("example_odc", "example_fsdp2", "parity_odc", "parity_single", "bad_entropy")
    names += tuple(f"parity_{which}_{kind}" for kind in MODEL_KINDS[1:] for which in ("odc", "single"))
    names += ("parity_odc_ordered", f"parity_odc_{HYBRID}", f"parity_single_{HYBRID}")
    out = {name: root / name for name in names}
    procs = {}
    procs["example_odc"] = background(
        accelerate_launch,
        CONFIGS / "odc_cpu.yaml",
        TRAIN,
        "--odc",
        "true",
        "--max_steps",
        "3",
        "--logging_steps",
        "1",
        "--max_completion_length",  # the example's 128 tokens: most of the run's time, decoding on CPU
        "32",
        "--output_dir",
        out["example_odc"],
        **COUNT,
    )
    procs["example_fsdp2"] = background(
        accelerate_launch,
        CONFIGS / "fsdp2_cpu.yaml",
        TRAIN,
        "--max_steps",
        "1",
        "--max_completion_length",
        "16",
        "--logging_steps",
        "1",
        "--output_dir",
        out["example_fsdp2"],
        **COUNT,
    )
    # The untied model with every loss type, the other kinds with one: ODC on 2 ranks and one process on the same
    # samples per step.
    parities = {"": PARITY}
    parities.update(
        {f"_{kind}": [*_one_loss_type(PARITY, "grpo"), *model_args(tiny_model, kind, hidden_size=32, aux=_aux(kind))]
         for kind in MODEL_KINDS[1:]}
    )  # fmt: skip
    parities["_ordered"] = [*_one_loss_type(PARITY, "grpo"), "--odc_reduction", "ordered"]
    parities[f"_{HYBRID}"] = [*_one_loss_type(PARITY, "grpo"), *model_args(tiny_model, HYBRID, 32), *HYBRID_SHORT]
    for suffix, parity in parities.items():
        procs[f"parity_odc{suffix}"] = background(
            accelerate_launch,
            CONFIGS / "odc_cpu.yaml",
            RUN_EXAMPLE,
            LOOP,
            "--odc",
            "true",
            "--odc_max_tokens_per_microbatch",
            MOE_BUDGET if suffix == "_moe" else "40",
            "--per_device_train_batch_size",
            "8",
            *parity,
            *(_extra_runs(0) if suffix == "" else []),
            "--output_dir",
            out[f"parity_odc{suffix}"],
            **COUNT,
        )
        if suffix == "_ordered":  # compared with the offline default's reference of grpo
            continue
        reference = [sys.executable, LOOP, "--reference", "true", "--per_device_train_batch_size", "16", *parity]
        if suffix == "_moe":  # the router term of each completion weighted by its share of the step's tokens
            reference += ["--aux_token_share", "true"]
        reference += _extra_runs(1) if suffix == "" else []
        procs[f"parity_single{suffix}"] = background(
            run, [*reference, "--output_dir", out[f"parity_single{suffix}"]], env=base_env()
        )
    procs["bad_entropy"] = background(
        accelerate_launch,
        CONFIGS / "odc_cpu.yaml",
        TRAIN,
        "--odc",
        "true",
        "--entropy_coef",
        "0.1",
        "--output_dir",
        out["bad_entropy"],
    )
    return {"out": out, "procs": results(procs), "shm_before": shm_before}


def _history(out) -> list[dict]:
    state = json.loads((out / "trainer_state.json").read_text())
    return [h for h in state["log_history"] if "loss" in h]


def test_example_runs_and_logs_per_step(runs):
    check_ok(runs["procs"]["example_odc"])
    history = _history(runs["out"]["example_odc"])
    assert [h["step"] for h in history] == [1, 2, 3]
    for h in history:
        for key in (
            "loss",
            "reward",
            "completions/mean_length",
            "completions/max_length",
            "odc/tokens_per_s",
            "odc/bubble_pct",
            *(f"odc/{what}_s_{stat}" for what in ("busy", "wait", "generation") for stat in ("min", "max", "mean")),
        ):
            assert key in h, (key, sorted(h))
        # generation is part of each rank's busy time (so of the extremes and means over ranks too)
        assert 0 < h["odc/generation_s_min"], h
        assert h["odc/generation_s_max"] <= h["odc/busy_s_max"] + 1e-3, h
        assert h["odc/generation_s_mean"] <= h["odc/busy_s_mean"] + 1e-3, h
    assert shm_leftovers() <= runs["shm_before"], "shared memory left behind"


def test_generation_and_microbatches_make_no_collective_under_odc(runs):
    check_ok(runs["procs"]["example_odc"])
    ranks = reports(runs["out"]["example_odc"], "odc_run_rank")
    assert len(ranks) == 2
    for r in ranks:
        assert r["engine"] == "ODCEngine"
        generation, microbatches = r["generation_dist_calls"], r["microbatch_dist_calls"]
        assert len(generation) >= 3 and all(c == {} for c in generation), generation
        assert len(microbatches) >= 3 and all(c == {} for c in microbatches), microbatches


def test_plain_fsdp2_generation_syncs_every_decode_step(runs):
    """The negative control: TRL on plain FSDP2 makes collectives inside generate (the counter sees them)."""
    check_ok(runs["procs"]["example_fsdp2"])
    ranks = reports(runs["out"]["example_fsdp2"], "odc_run_rank")
    for r in ranks:
        assert r["engine"] is None
        calls = r["generation_dist_calls"]
        assert calls and all(sum(c.values()) > 0 for c in calls), calls


@pytest.mark.parametrize("kind, loss_type", PARITY_RUNS)
def test_unequal_microbatches_match_one_process(runs, kind, loss_type):
    for name in _parity_names(kind):
        check_ok(runs["procs"][name])
    odc_dir, ref_dir = _parity_dirs(runs, kind, loss_type)
    odc = json.loads((odc_dir / "losses.json").read_text())["log_history"]
    ref = json.loads((ref_dir / "losses.json").read_text())["log_history"]
    odc, ref = [h for h in odc if "loss" in h], [h for h in ref if "loss" in h]
    assert len(odc) == len(ref) == (1 if kind == HYBRID else 2)
    if kind != "moe":  # the MoE's one completion per microbatch: the counts follow the lengths (8 and 8 seen)
        assert any(h["odc/microbatches_min"] != h["odc/microbatches_max"] for h in odc), "ranks ran equal microbatches"
    for mine, truth in zip(odc, ref, strict=True):
        assert mine["loss"] == pytest.approx(truth["loss"], rel=1e-4, abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(truth["grad_norm"], rel=GRPO_GRAD_NORM_REL)
        for key in ("kl", "entropy", "reward", "completions/mean_length", "clip_ratio/region_mean"):
            assert mine[key] == pytest.approx(truth[key], rel=1e-5, abs=1e-8), key
        if kind == "moe":
            # The router term on, one completion per microbatch (16 per step over the ranks), weighted by its share
            # of the step's tokens as in the reference; logged as the step's weighted sum (about 2 for top-2 of 4)
            assert mine["odc/microbatches_min"] + mine["odc/microbatches_max"] == 16, mine
            assert mine["aux_loss"] > 1.0
            assert mine["aux_loss"] == pytest.approx(truth["aux_loss"], rel=1e-5)
    a, b = torch.load(odc_dir / "final_params.pt"), torch.load(ref_dir / "final_params.pt")
    init = torch.load(ref_dir / "initial_params.pt")
    # Gated DeltaNet's decay parameters (A_log, dt_bias) get gradients of order 1e-6 on the tiny hybrid, where Adam's
    # first step (g / (|g| + 1e-8)) turns fp32 summation noise into percents of the learning rate: measured up to 3.1%
    # (A_log), every other parameter within 0.2%.
    decay = {k for k in b if kind == HYBRID and k.endswith(("linear_attn.A_log", "linear_attn.dt_bias"))}
    update = max(float((b[k] - init[k]).abs().max()) for k in b)
    diff = max(float((a[k] - b[k]).abs().max()) for k in b if k not in decay)
    assert update > 1e-4 and diff < 1e-2 * update, (diff, update)
    assert all(float((a[k] - b[k]).abs().max()) < 5e-2 * update for k in decay)
    for r in reports(odc_dir, "odc_run_rank"):
        assert r["reference_engine"] == "ODCEngine" and r["reference_gathers"] > 0
        assert r["microbatch_dist_calls"] and all(c == {} for c in r["microbatch_dist_calls"])
        assert r["reduction"] == ("ordered" if kind == "ordered" else "atomic")


def test_without_the_kl_term_the_gradient_norm_matches_one_process_to_1e_5(runs):
    # The control of GRPO_GRAD_NORM_REL (5e-5, allowing for the fp32 noise of the KL term): with beta=0 there is no
    # KL term and no reference model, and the gradient norm is held to 1e-5.
    check_ok(runs["procs"]["parity_odc"])
    check_ok(runs["procs"]["parity_single"])
    odc_dir, ref_dir = runs["out"]["parity_odc"] / "grpo_beta0", runs["out"]["parity_single"] / "grpo_beta0"
    odc = [h for h in json.loads((odc_dir / "losses.json").read_text())["log_history"] if "loss" in h]
    ref = [h for h in json.loads((ref_dir / "losses.json").read_text())["log_history"] if "loss" in h]
    assert len(odc) == len(ref) == 2
    assert any(h["odc/microbatches_min"] != h["odc/microbatches_max"] for h in odc), "ranks ran equal microbatches"
    for mine, truth in zip(odc, ref, strict=True):
        assert "kl" not in mine and "kl" not in truth  # TRL logs the KL term only when beta > 0
        assert mine["loss"] == pytest.approx(truth["loss"], rel=1e-4, abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(truth["grad_norm"], rel=1e-5)
    for r in reports(odc_dir, "odc_run_rank"):
        assert r["engine"] == "ODCEngine" and r["reference_engine"] is None


@pytest.mark.parametrize("name", ITERATION_RUNS)
def test_several_updates_per_generation_batch_match_one_process(runs, name):
    """Each optimizer step a generation batch feeds trains its slice of it (the gathered completions), once per
    iteration, with TRL's old log-probs: the losses, gradient norms, metrics and final weights are the one-process
    run's on the same completions per step."""
    check_ok(runs["procs"]["parity_odc"])
    check_ok(runs["procs"]["parity_single"])
    odc_dir, ref_dir = runs["out"]["parity_odc"] / name, runs["out"]["parity_single"] / name
    odc = [h for h in json.loads((odc_dir / "losses.json").read_text())["log_history"] if "loss" in h]
    ref = [h for h in json.loads((ref_dir / "losses.json").read_text())["log_history"] if "loss" in h]
    assert len(odc) == len(ref) == (4 if name == "gspo_iterations" else 2)
    # one generation batch for all the steps: TRL logs its rewards at the first step only
    assert ["reward" in h for h in odc] == ["reward" in h for h in ref] == [True] + [False] * (len(ref) - 1)
    for mine, truth in zip(odc, ref, strict=True):
        assert mine["loss"] == pytest.approx(truth["loss"], rel=1e-4, abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(truth["grad_norm"], rel=GRPO_GRAD_NORM_REL)
        assert mine["grad_norm"] > 0
        for key in ("kl", "entropy", "reward", "completions/mean_length", "clip_ratio/region_mean"):
            if key in truth:
                assert mine[key] == pytest.approx(truth[key], rel=1e-5, abs=1e-8), key
    # the later steps train with the policy moved since generation: the importance ratio is not 1, and the loss of
    # a slice trained again differs from its first pass
    if name == "gspo_iterations":
        assert abs(ref[2]["loss"] - ref[0]["loss"]) > 1e-3, [h["loss"] for h in ref]
    a, b = torch.load(odc_dir / "final_params.pt"), torch.load(ref_dir / "final_params.pt")
    init = torch.load(ref_dir / "initial_params.pt")
    # The weights' distance over the update's norm, not elementwise: AdamW moves an entry whose gradient is near zero
    # by up to its learning rate whatever fp32 noise that gradient carries (the ranks' adds and one process's sums
    # round differently), so single embedding entries came out up to 2.7% of the largest update apart while the whole
    # update agreed to 6e-5 (1.9e-6 to 6.3e-6 in other runs).
    update = sum(float((b[k] - init[k]).double().norm() ** 2) for k in b) ** 0.5
    diff = sum(float((a[k] - b[k]).double().norm() ** 2) for k in b) ** 0.5
    assert update > 1e-3 and diff < 1e-3 * update, (diff, update)
    for r in reports(odc_dir, "odc_run_rank"):
        assert r["microbatch_dist_calls"] and all(c == {} for c in r["microbatch_dist_calls"])


def test_inexact_option_is_refused_before_training(runs):
    proc = runs["procs"]["bad_entropy"]
    assert proc.returncode != 0
    assert "--entropy_coef 0" in proc.stderr, proc.stderr[-3000:]
    assert not (runs["out"]["bad_entropy"] / "trainer_state.json").exists()
    assert "completions/mean_length" not in proc.stdout + proc.stderr  # no step was logged
