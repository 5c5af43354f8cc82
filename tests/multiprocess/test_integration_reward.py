"""The reward-model example (examples/reward/train.py) and TRL's own ``trl/scripts/reward.py`` under real launches, 2 CPU
processes, offline assets (the tiny Qwen2 as a sequence classifier with one output, the DPO script's preference pairs).

Module-scoped runs (2 optimizer steps each, fp32, SGD, 5 pairs per step so the ranks run different numbers of
microbatches):

* ``odc``: ``--odc true`` (free plan); torch.distributed calls counted during microbatches.
* ``single``: TRL's own ``RewardTrainer`` in one process with the step's 5 pairs as one microbatch
  (`tests/helpers/trl_reference.py`): the ground truth for the exact pair-mean loss and for the step's metrics.
* ``idle``: ``--odc_plan dynamic`` with rank 1 claiming only once rank 0 has emptied the step's queue
  (``ODC_TEST_LATE_RANK``): rank 1 has no pair in any step.
* ``trl_script``: TRL's unmodified ``trl/scripts/reward.py`` under ``odc-accelerate launch`` with the example's
  ``odc_cpu.yaml`` (``odc: true``), on a local model folder (the offline default's initial weights) and a local
  JSON-lines dataset (the same pairs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from integration_utils import (
    ROOT,
    accelerate_launch,
    background,
    base_env,
    check_ok,
    final_params,
    logged_steps,
    max_rel,
    reports,
    results,
    run,
    shm_leftovers,
)

CONFIGS = ROOT / "examples" / "reward" / "configs"
TRAIN = ROOT / "examples" / "reward" / "train.py"

# Pairs longer than max_length are dropped (not truncated): 128 tokens keep 34 of them; the budget holds one longest
# pair (both rows padded to 128), so most microbatches hold one pair and 5 pairs split 3 / 2 over the ranks.
COMMON = [
    "--max_steps", "2", "--logging_steps", "1", "--report_to", "none", "--max_length", "128",
    "--odc_max_tokens_per_microbatch", "256", "--optim", "sgd", "--learning_rate", "0.2", "--seed", "0",
    "--dataloader_pin_memory", "false", "--odc_samples_per_step", "5",
]  # fmt: skip
SAMPLES_PER_STEP = 5
NO_SAVE = ["--save_strategy", "no"]
METRICS = ("min_reward", "mean_reward", "max_reward", "accuracy", "margin")
DUMP = {"ODC_DUMP_PARAMS": "1"}
COUNT = {"ODC_COUNT_DIST_CALLS": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, references):
    import trl

    from odc_accelerate.demo import offline_dpo_dataset
    from odc_accelerate.testing.models import save_tiny_reward_model

    root = tmp_path_factory.mktemp("reward")
    shm_before = shm_leftovers()
    out = {name: root / name for name in ("odc", "single", "idle", "trl_script")}
    procs = {}
    procs["single"], out["single"] = references.start("reward", SAMPLES_PER_STEP, *COMMON, *NO_SAVE)
    odc = [CONFIGS / "odc_cpu.yaml", TRAIN, "--odc", "true", *COMMON, *NO_SAVE]
    procs["odc"] = background(accelerate_launch, *odc, "--output_dir", out["odc"], **COUNT, **DUMP)
    claims = root / "claims"
    procs["idle"] = background(
        accelerate_launch,
        *odc,
        "--odc_plan",
        "dynamic",
        "--output_dir",
        out["idle"],
        ODC_TEST_CLAIMS_DIR=str(claims),
        ODC_TEST_LATE_RANK="1",
        **COUNT,
        **DUMP,
    )

    # TRL's script: the offline default's initial weights in a model folder, the same pairs as JSON lines
    model_dir, data_dir = save_tiny_reward_model("untied", root / "model"), root / "data"
    data_dir.mkdir()
    with open(data_dir / "train.jsonl", "w") as f:
        for row in offline_dpo_dataset():
            f.write(json.dumps(row) + "\n")
    env = {"HF_DATASETS_CACHE": str(root / "hf_datasets"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    script = Path(trl.__file__).parent / "scripts" / "reward.py"
    launch = [sys.executable, "-m", "odc_accelerate.cli", "launch", "--config_file", CONFIGS / "odc_cpu.yaml"]
    cmd = [*launch, "--main_process_port", "0", script, "--model_name_or_path", model_dir, "--dataset_name", data_dir]
    # no --save_strategy no: TRL's script saves no trainer state itself, the Trainer's final checkpoint holds it
    procs["trl_script"] = background(
        run, [*cmd, *COMMON, "--output_dir", out["trl_script"]], env=base_env(**env), timeout=400
    )
    return {"out": out, "procs": results(procs), "shm_before": shm_before, "model_dir": model_dir}


def _update(out: Path) -> float:
    a, init = final_params(out), torch.load(out / "initial_params.pt")
    return sum(float((a[k] - init[k]).norm() ** 2) for k in a) ** 0.5


def _same_steps(run_steps: list[dict], single_steps: list[dict]) -> None:
    assert len(run_steps) == len(single_steps) == 2
    for a, b in zip(run_steps, single_steps, strict=True):
        # the mean over every pair of the global batch
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)  # fp32 summation order
        # TRL's metrics of the whole step: rewards over every row, accuracy and margin over every pair
        for key in METRICS:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        assert a["num_tokens"] == b["num_tokens"]
    # the rewards moved apart in step 2 (a check that cannot pass with all-zero metrics)
    assert single_steps[1]["margin"] != 0.0 and single_steps[1]["max_reward"] > single_steps[1]["min_reward"]


def _same_weights(a: dict, b: dict, init: dict) -> None:
    diff = sum(float((a[k] - b[k]).norm() ** 2) for k in b) ** 0.5
    update = sum(float((b[k] - init[k]).norm() ** 2) for k in b) ** 0.5
    assert update > 0 and diff / update <= 1e-4, (diff, update)


def test_odc_reward_matches_trls_own_trainer_in_one_process(runs):
    check_ok(runs["procs"]["odc"])
    check_ok(runs["procs"]["single"])
    odc, single = runs["out"]["odc"], runs["out"]["single"]
    history = logged_steps(odc)
    _same_steps(history, logged_steps(single))
    for h in history:
        for key in ("odc/tokens_per_s", "odc/bubble_pct", "odc/busy_s_max"):
            assert key in h, key
    # unequal microbatch counts, and no collective inside any of them
    assert any(h["odc/microbatches_min"] != h["odc/microbatches_max"] for h in history)
    ranks = reports(odc, "odc_run_rank")
    assert len(ranks) == 2
    for r in ranks:
        assert r["engine"] == "ODCEngine" and r["fsdp_plugin"] == "ODCPlugin"
        calls = r["microbatch_dist_calls"]
        assert len(calls) >= 2 and all(c == {} for c in calls), calls
    _same_weights(final_params(odc), final_params(single), torch.load(single / "initial_params.pt"))
    assert max_rel(torch.load(odc / "initial_params.pt"), torch.load(single / "initial_params.pt")) == 0.0


def test_a_rank_with_no_pair_in_a_step_trains_as_one_process(runs):
    check_ok(runs["procs"]["idle"])
    check_ok(runs["procs"]["single"])
    idle, single = runs["out"]["idle"], runs["out"]["single"]
    ranks = {r["rank"]: r for r in reports(idle, "odc_run_rank")}
    assert [r["odc_config"]["plan"] for r in ranks.values()] == ["dynamic", "dynamic"]
    # rank 1 claimed nothing in either step; rank 0 ran all 5 pairs of each
    assert ranks[1]["claimed"] == [[], []], ranks[1]["claimed"]
    assert len(ranks[0]["claimed"]) == 2 and all(ranks[0]["claimed"])
    assert all(c == {} for c in ranks[0]["microbatch_dist_calls"])
    history = logged_steps(idle)
    assert [h["odc/microbatches_min"] for h in history] == [0, 0]
    _same_steps(history, logged_steps(single))
    _same_weights(final_params(idle), final_params(single), torch.load(single / "initial_params.pt"))


def test_trls_own_reward_script_trains_with_odc_under_launch(runs):
    from safetensors.torch import load_file

    proc = runs["procs"]["trl_script"]
    check_ok(proc)
    check_ok(runs["procs"]["single"])
    out, single = runs["out"]["trl_script"], runs["out"]["single"]
    history = logged_steps(out / "checkpoint-2")
    assert all("odc/step_s" in h for h in history), history
    assert any(h["odc/microbatches_min"] != h["odc/microbatches_max"] for h in history), history
    # the model folder held the reference's starting weights, and TRL's script trained as TRL in one process
    init = torch.load(single / "initial_params.pt")
    assert max_rel(load_file(runs["model_dir"] / "model.safetensors"), init) == 0.0
    _same_steps(history, logged_steps(single))
    _same_weights(load_file(out / "model.safetensors"), torch.load(single / "final_params.pt"), init)


def test_no_shared_memory_left(runs):
    assert shm_leftovers() <= runs["shm_before"]
