"""The KTO example (examples/kto/train.py) and TRL's own ``trl/scripts/kto.py`` under real launches, 2 CPU processes,
offline assets (the tiny Qwen2, the DPO script's preference pairs, which TRL's KTO trainer unpairs).

Module-scoped runs (2 optimizer steps each, fp32, SGD, 5 examples per step so the ranks run different numbers of
microbatches, ``per_device_train_batch_size 2``: TRL's KL pairs rotate the completions within blocks of 2 rows):

* ``odc``: ``--odc true`` (free plan), the reference model served by the gather-only engine; torch.distributed calls
  counted during microbatches.
* ``single``: TRL's own ``KTOTrainer`` in one process with the step's 5 examples as one microbatch and the same KL
  pairs (`tests/helpers/loops/trl_reference.py kto`): TRL's KL estimate over the whole global batch, the definition
  ODC computes once per step, and TRL's mean over the step's examples.
* ``trl_script``: TRL's unmodified ``trl/scripts/kto.py`` under ``odc-accelerate launch`` with the example's
  ``odc_cpu.yaml`` (``odc: true``), on a local model folder (the offline default's initial weights) and a local
  JSON-lines dataset (the same pairs), with ``--precompute_ref_log_probs true``.
* ``odc_moe`` / ``single_moe``: ``odc`` and ``single`` for one step on a Qwen3-MoE (the session's `tiny_model`) with
  the router's auxiliary loss (``MOE_AUX_COEF``), at ``--max_length 128`` (examples of unequal lengths, one per
  microbatch); the reference weights each example's own term by its share of the step's non-padding tokens, the
  definition ODC trains it with.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from integration_utils import (
    MOE_AUX_COEF,
    ROOT,
    accelerate_launch,
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
    shm_leftovers,
)

CONFIGS = ROOT / "examples" / "kto" / "configs"
TRAIN = ROOT / "examples" / "kto" / "train.py"

COMMON = [
    "--max_steps", "2", "--logging_steps", "1", "--report_to", "none", "--max_length", "64",
    "--per_device_train_batch_size", "2", "--odc_max_tokens_per_microbatch", "64", "--optim", "sgd",
    "--learning_rate", "0.2", "--seed", "2", "--dataloader_pin_memory", "false", "--odc_samples_per_step", "5",
    "--gradient_checkpointing", "false",
]  # fmt: skip
# seed 2: both steps hold desirable and undesirable examples (3 + 2, then 2 + 3), and z0 is above 0 in step 2
SAMPLES_PER_STEP = 5
NO_SAVE = ["--save_strategy", "no"]
METRICS = ("kl", "entropy", "logits/chosen", "logits/rejected", "rewards/chosen", "rewards/rejected")
METRICS += ("rewards/margins", "logps/chosen", "logps/rejected")
# One step on the MoE (later values win over COMMON's): with seed 9 the step's examples hold 79 to 128 tokens at this
# max_length (the suite's vocabulary), and no two share a microbatch of this budget, so their shares differ. The
# gradient norm (1.4) is clipped to the default 1.0. The logged norms differ by ~4e-5 while the gradients agree to
# ~5e-7 (their float64 norms to ~1e-7): torch's CPU float32 L2 norm accumulates each vector lane in one float32, so its
# error grows with a tensor's length (pytorch/pytorch#169237), and one process's norm of the whole LM head gradient
# (8,448 x 64) comes out ~2e-4 low where each ODC rank's norm of its half comes out closer to the float64 value.
MOE_STEP = ["--max_steps", "1", "--max_length", "128", "--odc_max_tokens_per_microbatch", "128", "--seed", "9"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, references, tiny_model):
    import trl

    from odc_accelerate.demo import offline_dpo_dataset
    from odc_accelerate.testing.models import save_tiny_causal_lm

    root = tmp_path_factory.mktemp("kto")
    shm_before = shm_leftovers()
    out = {name: root / name for name in ("odc", "single", "trl_script", "odc_moe", "single_moe")}
    procs = {}
    moe = [*COMMON, *model_args(tiny_model, "moe", aux=MOE_AUX_COEF), *MOE_STEP, *NO_SAVE]
    procs["single_moe"], out["single_moe"] = references.start("kto", SAMPLES_PER_STEP, *moe, "--aux_token_share")
    trace = {"ODC_TRACE_DIR": str(out["odc_moe"] / "trace")}
    procs["odc_moe"] = background(
        accelerate_launch, CONFIGS / "odc_cpu.yaml", TRAIN, "--odc", "true", *moe, "--output_dir", out["odc_moe"],
        ODC_DUMP_PARAMS="1", **trace,
    )  # fmt: skip
    procs["single"], out["single"] = references.start("kto", SAMPLES_PER_STEP, *COMMON, *NO_SAVE)
    odc = [CONFIGS / "odc_cpu.yaml", TRAIN, "--odc", "true", *COMMON, *NO_SAVE]
    procs["odc"] = background(
        accelerate_launch, *odc, "--output_dir", out["odc"], ODC_COUNT_DIST_CALLS="1", ODC_DUMP_PARAMS="1"
    )
    # TRL's script: the offline default's initial weights in a model folder, the same pairs as JSON lines
    model_dir, data_dir = save_tiny_causal_lm("untied", root / "model", seed=2), root / "data"
    data_dir.mkdir()
    with open(data_dir / "train.jsonl", "w") as f:
        for row in offline_dpo_dataset():
            f.write(json.dumps(row) + "\n")
    env = {"HF_DATASETS_CACHE": str(root / "hf_datasets"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    script = Path(trl.__file__).parent / "scripts" / "kto.py"
    launch = [sys.executable, "-m", "odc_accelerate.cli", "launch", "--config_file", CONFIGS / "odc_cpu.yaml"]
    cmd = [*launch, "--main_process_port", "0", script, "--model_name_or_path", model_dir, "--dataset_name", data_dir]
    cmd += ["--precompute_ref_log_probs", "true", "--precompute_ref_batch_size", "64"]
    # no --save_strategy no: TRL's script saves no trainer state itself, the Trainer's final checkpoint holds it
    procs["trl_script"] = background(
        run, [*cmd, *COMMON, "--output_dir", out["trl_script"]], env=base_env(**env), timeout=600
    )
    return {"out": out, "procs": results(procs), "shm_before": shm_before, "model_dir": model_dir}


def _same_steps(run_steps: list[dict], single_steps: list[dict], rel: float = 1e-5) -> None:
    assert len(run_steps) == len(single_steps) == 2
    for a, b in zip(run_steps, single_steps, strict=True):
        # the mean over every example of the global batch, with z0 over every KL pair of the step
        assert a["loss"] == pytest.approx(b["loss"], rel=rel)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)  # fp32 summation order
        assert {k for k in a if not k.startswith("odc/")} == set(b), (a, b)
        for key in METRICS:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        assert a["num_tokens"] == b["num_tokens"]
    # step 1: policy = reference (z0 = 0, rewards 0); step 2: the policy moved, so z0 and the rewards did (checks that
    # cannot pass with all-zero values)
    assert single_steps[0]["kl"] == 0.0 and single_steps[1]["kl"] > 0.0
    assert single_steps[1]["rewards/margins"] != 0.0


def _same_weights(a: dict, b: dict, init: dict) -> float:
    """Asserts ``a`` and ``b`` moved the same way from ``init``; the norm of ``b``'s update."""
    diff = sum(float((a[k] - b[k]).norm() ** 2) for k in b) ** 0.5
    update = sum(float((b[k] - init[k]).norm() ** 2) for k in b) ** 0.5
    assert update > 0 and diff / update <= 1e-4, (diff, update)
    return update


def test_odc_kto_matches_trls_own_trainer_in_one_process(runs):
    check_ok(runs["procs"]["odc"])
    check_ok(runs["procs"]["single"])
    odc, single = runs["out"]["odc"], runs["out"]["single"]
    history = logged_steps(odc)
    _same_steps(history, logged_steps(single))
    # unequal microbatch counts, and no collective inside any of them (z0 came from the step's one all-reduce)
    assert any(h["odc/microbatches_min"] != h["odc/microbatches_max"] for h in history)
    ranks = reports(odc, "odc_run_rank")
    assert len(ranks) == 2
    for r in ranks:
        assert r["engine"] == "ODCEngine" and r["reference_engine"] == "ODCEngine" and r["reference_gathers"] > 0
        calls = r["microbatch_dist_calls"]
        assert len(calls) >= 2 and all(c == {} for c in calls), calls
    init = torch.load(single / "initial_params.pt")
    assert max_rel(torch.load(odc / "initial_params.pt"), init) == 0.0
    _same_weights(final_params(odc), final_params(single), init)


def test_trls_own_kto_script_trains_with_odc_under_launch(runs):
    from safetensors.torch import load_file

    check_ok(runs["procs"]["trl_script"])
    check_ok(runs["procs"]["single"])
    out, single = runs["out"]["trl_script"], runs["out"]["single"]
    history = logged_steps(out / "checkpoint-2")
    assert all("odc/step_s" in h for h in history), history
    assert any(h["odc/microbatches_min"] != h["odc/microbatches_max"] for h in history), history
    init = torch.load(single / "initial_params.pt")
    assert max_rel(load_file(runs["model_dir"] / "model.safetensors"), init) == 0.0
    # the reference log-probs were precomputed (in batches of their own), so the loss agrees to fp32 noise
    _same_steps(history, logged_steps(single), rel=1e-4)
    _same_weights(load_file(out / "model.safetensors"), torch.load(single / "final_params.pt"), init)


def test_moe_router_aux_loss_matches_one_process_weighting_it_the_same_way(runs):
    """A MoE's router auxiliary loss under the free plan: each microbatch's term weighted by its share of the step's
    routed tokens, against one process weighting each example's own term so; the logged ``aux_loss`` is the step's
    weighted sum."""
    check_ok(runs["procs"]["odc_moe"])
    check_ok(runs["procs"]["single_moe"])
    odc, single = runs["out"]["odc_moe"], runs["out"]["single_moe"]
    (a,), (b,) = logged_steps(odc), logged_steps(single)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert a["aux_loss"] == pytest.approx(b["aux_loss"], rel=1e-5)
    assert a["aux_loss"] > 1.0  # E x sum_e f_e P_e: 2 (top-2) for a balanced router
    for key in METRICS:
        if key in b:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    # one example per microbatch (5 over the ranks), unequal counts: the reference's per-example terms are ODC's
    traced = [json.loads((odc / "trace" / f"trace_rank{r}.jsonl").read_text().splitlines()[0]) for r in (0, 1)]
    assert sorted(len(t["microbatches"]) for t in traced) == [2, 3]
    tokens = [mb["row_tokens"] for t in traced for mb in t["microbatches"]]
    assert all(len(row) == 1 for row in tokens) and len({row[0] for row in tokens}) > 1  # unequal shares
    init = torch.load(single / "initial_params.pt")
    assert max_rel(torch.load(odc / "initial_params.pt"), init) == 0.0
    # clipped: one SGD step of the learning rate times max_grad_norm (1.0)
    assert _same_weights(final_params(odc), final_params(single), init) == pytest.approx(0.2, rel=1e-4)


def test_no_shared_memory_left(runs):
    assert shm_leftovers() <= runs["shm_before"]
