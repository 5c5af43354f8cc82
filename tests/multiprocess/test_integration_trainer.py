"""A plain `transformers.Trainer` script under ``odc-accelerate launch``: 2 CPU processes, 2 optimizer steps.

``examples/trainer/run_clm.py`` (a run_clm-shaped script: ``Trainer(model, args, train_dataset,
data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))``, no ODC code) trains WITH ODC under
``odc-accelerate launch`` and the ODC CPU config, unmodified; so do the same script with a ``class MyTrainer(Trainer)``
of its own (collating with ``DataCollatorWithFlattening``) and with ``class MyTrainer(ODCTrainerMixin, Trainer)``
written in. Each trains 5 samples per step (the ranks run unequal microbatch counts on the free plan) as the same
script's plain ``Trainer`` does in one process on the same samples per step (`tests/helpers/loops/trainer_reference.py`),
and as plain FSDP2 (ODC off) does on the lockstep plan, to fp32 summation order. The mixin's run and plain FSDP2's
train a Qwen3-MoE whose forward adds its router's auxiliary loss, on samples of up to 256 tokens of different lengths,
one sample per microbatch, against the reference weighting each microbatch's term by its share of the step's tokens.
Plain FSDP2 has 3 slots per rank for 5 samples, so one rank's third slot cannot be filled and runs as a zero-weight
microbatch that keeps FSDP2's collectives paired (no hang, nothing added to the step).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from integration_utils import (
    CONFIGS,
    MOE_AUX_COEF,
    RUN_EXAMPLE,
    background,
    base_env,
    check_ok,
    final_params,
    logged_steps,
    max_rel,
    reports,
    results,
    run,
)

ROOT = Path(__file__).resolve().parents[2]
RUN_CLM = ROOT / "examples" / "trainer" / "run_clm.py"
REFERENCE = ROOT / "tests" / "helpers" / "loops" / "trainer_reference.py"
SAMPLES_PER_STEP = 5
# 2 steps of SGD with momentum, fp32, as the SFT parity runs; samples of at most 128 tokens
PARITY = [
    "--max_steps", "2", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no", "--block_size", "128",
    "--optim", "sgd", "--optim_args", "momentum=0.9", "--learning_rate", "0.5", "--seed", "0",
    "--dataloader_pin_memory", "false",
]  # fmt: skip
# what odc-accelerate launch exports from a config's odc_samples_per_step / odc_max_tokens_per_microbatch keys
PLAN_ENV = {
    "ODC_SAMPLES_PER_STEP": str(SAMPLES_PER_STEP),
    # two 128-token samples fit one microbatch (plain FSDP2 on lockstep: one, see the module docstring)
    "ODC_MAX_TOKENS_PER_MICROBATCH": "256",
    "ODC_DUMP_PARAMS": "1",
}


def _variant(source: str, base: str, imports: str = "") -> str:
    """run_clm.py with its trainer built from ``class MyTrainer(<base>)`` defined in the script."""
    head, main = source.split("\ndef main() -> None:", 1)
    assert "    trainer = Trainer(" in main
    main = main.replace("    trainer = Trainer(", "    trainer = MyTrainer(")
    future = "from __future__ import annotations\n"
    head = head.replace(future, future + imports, 1)
    return f"{head}\nclass MyTrainer({base}):\n    pass\n\n\ndef main() -> None:{main}"


def _moe_with_router_loss(tiny_model, root: Path) -> Path:
    """The session's tiny Qwen3-MoE, saved with ``output_router_logits=True`` (its forward then adds the router's
    auxiliary loss to the loss it returns, the plain Trainer's case) at coefficient ``MOE_AUX_COEF``."""
    folder = root / "moe_router_loss"
    shutil.copytree(tiny_model("moe"), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(output_router_logits=True, router_aux_loss_coef=MOE_AUX_COEF)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("trainer")
    source = RUN_CLM.read_text()
    subclass, mixin = root / "subclass_clm.py", root / "mixin_clm.py"
    subclass.write_text(_variant(source, "Trainer"))
    mixin.write_text(_variant(source, "ODCTrainerMixin, Trainer", "from odc_accelerate import ODCTrainerMixin\n"))
    out = {name: root / name for name in ("odc", "subclass", "mixin", "fsdp2", "reference", "reference_moe")}
    # The mixin and plain FSDP2 runs train the MoE with its router's auxiliary loss on samples of up to 256 tokens
    # (lengths differ: token shares are not row shares), one sample per microbatch (a 256-token budget; every sample of
    # these steps is over 128 tokens), against a reference weighting each microbatch's term by its share of the step's
    # tokens.
    moe = ["--model_name_or_path", str(_moe_with_router_loss(tiny_model, root)), "--block_size", "256"]
    env = dict(PLAN_ENV)  # the offline text is built in memory: no Hub, no datasets cache
    odc_launch = [sys.executable, "-m", "odc_accelerate.cli", "launch", "--config_file", CONFIGS / "odc_cpu.yaml"]
    odc_launch += ["--main_process_port", "0", RUN_EXAMPLE]

    def launched(cmd: list, **extra: str):
        return run(cmd, env=base_env(**{**env, **extra}), timeout=400)

    jobs = {
        "reference": background(
            run,
            [
                sys.executable,
                REFERENCE,
                "--samples_per_step",
                SAMPLES_PER_STEP,
                RUN_CLM,
                *PARITY,
                "--output_dir",
                out["reference"],
            ],
            env=base_env(**env),
            timeout=400,
        ),
        "reference_moe": background(
            run,
            [
                sys.executable,
                REFERENCE,
                "--samples_per_step",
                SAMPLES_PER_STEP,
                "--aux_token_share",
                RUN_CLM,
                *PARITY,
                *moe,
                "--output_dir",
                out["reference_moe"],
            ],  # fmt: skip
            env=base_env(**env),
            timeout=400,
        ),
        "odc": background(launched, [*odc_launch, RUN_CLM, *PARITY, "--output_dir", out["odc"]]),
        "subclass": background(
            launched, [*odc_launch, subclass, *PARITY, "--collator", "flattening", "--output_dir", out["subclass"]]
        ),
        "mixin": background(
            launched,
            [*odc_launch, mixin, *PARITY, *moe, "--output_dir", out["mixin"]],
            ODC_MAX_TOKENS_PER_MICROBATCH="256",
        ),
        # plain FSDP2 on the lockstep plan: the script through the bootstrap (which gives it the ODC trainer) with
        # ODC off, as the launcher starts it when ODC is on
        "fsdp2": background(
            launched,
            [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                CONFIGS / "fsdp2_cpu.yaml",
                "--main_process_port",
                "0",
                "--module",
                "odc_accelerate.cli.bootstrap",
                RUN_EXAMPLE,
                RUN_CLM,
                *PARITY,
                *moe,
                "--output_dir",
                out["fsdp2"],
            ],  # fmt: skip
            ODC_PLAN="lockstep",
            # one sample per microbatch: 6 slots for 5 samples, one of them empty on one rank
            ODC_MAX_TOKENS_PER_MICROBATCH="256",
        ),
    }
    return {"procs": results(jobs), "out": out}


def _assert_trains_as_one_process(runs, name: str, reference: str = "reference") -> list[dict]:
    """Run ``name`` logged the ``reference``'s loss and gradient norm at both steps and ended with its weights."""
    import torch

    check_ok(runs["procs"][reference])
    proc = runs["procs"][name]
    check_ok(proc)
    out, ref = runs["out"][name], runs["out"][reference]
    init = torch.load(ref / "initial_params.pt")
    assert max_rel(torch.load(out / "initial_params.pt"), init) == 0.0  # the same starting weights
    steps = logged_steps(out)
    for a, b in zip(steps, logged_steps(ref), strict=True):
        # the per-token mean over every label token of the step, on all ranks
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)  # fp32 summation order
    trained, expected = final_params(out), torch.load(ref / "final_params.pt")
    diff = sum(float((trained[k] - expected[k]).norm() ** 2) for k in expected) ** 0.5
    update = sum(float((expected[k] - init[k]).norm() ** 2) for k in expected) ** 0.5
    assert update > 0 and diff / update <= 1e-4, (diff, update)
    assert max_rel(trained, expected) <= 1e-4
    return steps


def _assert_odc(runs, name: str) -> None:
    """Run ``name`` trained with the ODC engine on the free plan, the ranks running unequal microbatch counts."""
    proc = runs["procs"][name]
    assert "ODC on: transport shm" in proc.stderr
    for report in reports(runs["out"][name], "odc_run_rank"):
        assert report["engine"] == "ODCEngine" and report["fsdp_plugin"] == "ODCPlugin", report
        assert report["odc_config"]["plan"] == "free" and report["odc_config"]["samples_per_step"] == SAMPLES_PER_STEP
    steps = logged_steps(runs["out"][name])
    assert any(step["odc/microbatches_min"] != step["odc/microbatches_max"] for step in steps), steps


def test_run_clm_unmodified_trains_with_odc_as_one_process(runs):
    _assert_trains_as_one_process(runs, "odc")
    _assert_odc(runs, "odc")


def test_a_script_defined_trainer_subclass_trains_with_odc_as_one_process(runs):
    _assert_trains_as_one_process(runs, "subclass")
    _assert_odc(runs, "subclass")


def test_the_mixin_written_in_trains_a_moe_with_its_router_loss_with_odc_as_one_process(runs):
    """The model's forward adds its router's auxiliary loss to the loss: each microbatch's term weighted by its share of
    the step's routed tokens (one sample per microbatch, unequal counts per rank), as the reference weights it."""
    steps = _assert_trains_as_one_process(runs, "mixin", "reference_moe")
    _assert_odc(runs, "mixin")
    assert all(step["odc/microbatches_min"] + step["odc/microbatches_max"] == SAMPLES_PER_STEP for step in steps)


def test_plain_fsdp2_on_the_lockstep_plan_trains_as_one_process(runs):
    """Plain FSDP2 on the lockstep plan, the MoE's router term weighted as under ODC."""
    steps = _assert_trains_as_one_process(runs, "fsdp2", "reference_moe")
    for report in reports(runs["out"]["fsdp2"], "odc_run_rank"):
        assert report["engine"] is None and report["distributed_type"] == "DistributedType.FSDP", report
        assert report["odc_config"]["plan"] == "lockstep" and not report["odc_config"]["enable"], report
        assert report["odc_config"]["max_tokens_per_microbatch"] == 256, report
    assert "ODC on:" not in runs["procs"]["fsdp2"].stderr
    assert len(steps) == 2
    # 3 microbatches on each rank (the zero-weight one included) for 5 samples of one microbatch each
    assert all(step["odc/microbatches_min"] == step["odc/microbatches_max"] == 3 for step in steps), steps


# ---------------------------------------------------------------------------------------------------- run_glue-shaped
# tests/helpers/loops/run_glue.py: a tiny Qwen2ForSequenceClassification, one label per sample, the Trainer's default
# DataCollatorWithPadding; 2 x 3 x 2 = 12 samples per step from --gradient_accumulation_steps 2 (folded into the plan)
RUN_GLUE = ROOT / "tests" / "helpers" / "loops" / "run_glue.py"
GLUE_SAMPLES_PER_STEP = 12
GLUE = [
    *PARITY[: PARITY.index("--block_size")],
    *PARITY[PARITY.index("--block_size") + 2 :],
    "--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def glue_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("glue")
    out = {name: root / name for name in ("odc", "reference", "own_loader")}
    odc_launch = [sys.executable, "-m", "odc_accelerate.cli", "launch", "--config_file", CONFIGS / "odc_cpu.yaml"]
    odc_launch += ["--main_process_port", "0", RUN_EXAMPLE, RUN_GLUE]
    # one 64-token padded microbatch at most (the longest sample): several microbatches per rank, of 1 to 3 rows
    env = base_env(ODC_MAX_TOKENS_PER_MICROBATCH="64", ODC_DUMP_PARAMS="1")
    jobs = {
        "odc": background(
            run,
            [*odc_launch, "--own_loss", "true", *GLUE, "--log_level", "info", "--output_dir", out["odc"]],
            env=env,
            timeout=400,
        ),
        "reference": background(
            run,
            [sys.executable, REFERENCE, "--samples_per_step", GLUE_SAMPLES_PER_STEP, RUN_GLUE, "--own_loss", "true"]
            + [*GLUE, "--output_dir", out["reference"]],
            env=env,
            timeout=400,
        ),
        "own_loader": background(
            run, [*odc_launch, "--own_loader", "true", *GLUE, "--output_dir", out["own_loader"]], env=env, timeout=400
        ),
    }
    return {"procs": results(jobs), "out": out}


def test_a_scripts_per_batch_mean_loss_on_sequence_classification_trains_as_one_process(glue_runs):
    """run_glue's collator and labels are served (no refusal), and a MyTrainer whose compute_loss is the batch's mean
    (the Trainer divides it by the accumulation steps) trains, on planned microbatches of unequal rows, as the script
    does in one process on the same 12 samples per step: each microbatch's mean weighted by rows x W / rows of the
    step."""
    import torch

    for name in ("odc", "reference"):
        check_ok(glue_runs["procs"][name])
    out, ref = glue_runs["out"]["odc"], glue_runs["out"]["reference"]
    assert "ODC on: transport shm" in glue_runs["procs"]["odc"].stderr
    steps = logged_steps(out)
    assert len(steps) == 2 and all(step["odc/microbatches_max"] >= 2 for step in steps), steps
    for a, b in zip(steps, logged_steps(ref), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)  # fp32 summation order
    init = torch.load(ref / "initial_params.pt")
    assert max_rel(torch.load(out / "initial_params.pt"), init) == 0.0
    trained, expected = final_params(out), torch.load(ref / "final_params.pt")
    assert max(float((expected[k] - init[k]).abs().max()) for k in expected) > 0
    assert max_rel(trained, expected) <= 1e-4


def test_the_trainers_own_throughput_and_banner_count_the_planned_step(glue_runs):
    """The Trainer's train_samples_per_second counts the 12 samples of each planned step (not the 3 x 1 x 2 of the
    folded accumulation), and its banner's total train batch size is the planned step."""
    check_ok(glue_runs["procs"]["odc"])
    metrics = json.loads((glue_runs["out"]["odc"] / "train_results.json").read_text())
    trained = 2 * GLUE_SAMPLES_PER_STEP
    assert metrics["train_samples_per_second"] * metrics["train_runtime"] == pytest.approx(trained, rel=2e-3)
    stderr = glue_runs["procs"]["odc"].stderr
    assert f"Total train batch size (w. parallel, distributed & accumulation) = {GLUE_SAMPLES_PER_STEP}" in stderr


def test_a_scripts_own_training_loader_is_refused_by_name_on_every_rank_before_training(glue_runs):
    """Each rank refuses from its own class when the Trainer has built the loader, before the model is prepared (no
    collective, so no rank waits on another; the launcher may stop a peer before it prints its own refusal)."""
    proc = glue_runs["procs"]["own_loader"]
    assert proc.returncode != 0
    refusal = "ValueError: __main__.MyLoaderTrainer.get_train_dataloader returns a DataLoader of batches of its own"
    assert f"[rank0]: {refusal}" in proc.stderr, proc.stderr[-4000:]
    assert "Remove the override" in proc.stderr and "ODC on:" not in proc.stderr
    assert not (glue_runs["out"]["own_loader"] / "trainer_state.json").exists()
