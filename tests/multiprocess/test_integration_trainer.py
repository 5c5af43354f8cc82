"""A plain `transformers.Trainer` script under ``odc-accelerate launch``: 2 CPU processes, 2 optimizer steps.

``examples/trainer/run_clm.py`` (a run_clm-shaped script: ``Trainer(model, args, train_dataset,
data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))``, no ODC code) trains WITH ODC under
``odc-accelerate launch`` and the ODC CPU config, unmodified; so do the same script with a ``class MyTrainer(Trainer)``
of its own (collating with ``DataCollatorWithFlattening``) and with ``class MyTrainer(ODCTrainerMixin, Trainer)``
written in. Each trains 5 samples per step (the ranks run unequal microbatch counts on the free plan) as the same
script's plain ``Trainer`` does in one process on the same samples per step (`tests/helpers/loops/trainer_reference.py`),
and as plain FSDP2 (ODC off) does on the lockstep plan, to fp32 summation order. Plain FSDP2 runs with a budget of one
128-token block per microbatch: 3 slots per rank for 5 samples, so one rank's third slot cannot be filled and runs as
a zero-weight microbatch that keeps FSDP2's collectives paired (no hang, nothing added to the step).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from integration_utils import (
    CONFIGS,
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    source = RUN_CLM.read_text()
    subclass, mixin = root / "subclass_clm.py", root / "mixin_clm.py"
    subclass.write_text(_variant(source, "Trainer"))
    mixin.write_text(_variant(source, "ODCTrainerMixin, Trainer", "from odc_accelerate import ODCTrainerMixin\n"))
    out = {name: root / name for name in ("odc", "subclass", "mixin", "fsdp2", "reference")}
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
        "odc": background(launched, [*odc_launch, RUN_CLM, *PARITY, "--output_dir", out["odc"]]),
        "subclass": background(
            launched, [*odc_launch, subclass, *PARITY, "--collator", "flattening", "--output_dir", out["subclass"]]
        ),
        "mixin": background(launched, [*odc_launch, mixin, *PARITY, "--output_dir", out["mixin"]]),
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
                "--output_dir",
                out["fsdp2"],
            ],  # fmt: skip
            ODC_PLAN="lockstep",
            # one 128-token block per microbatch: 6 slots for 5 samples, one of them empty on one rank
            ODC_MAX_TOKENS_PER_MICROBATCH="128",
        ),
    }
    return {"procs": results(jobs), "out": out}


def _assert_trains_as_one_process(runs, name: str) -> list[dict]:
    """Run ``name`` logged the reference's loss and gradient norm at both steps and ended with its weights."""
    import torch

    check_ok(runs["procs"]["reference"])
    proc = runs["procs"][name]
    check_ok(proc)
    out, ref = runs["out"][name], runs["out"]["reference"]
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


def test_the_mixin_written_in_trains_with_odc_as_one_process(runs):
    _assert_trains_as_one_process(runs, "mixin")
    _assert_odc(runs, "mixin")


def test_plain_fsdp2_on_the_lockstep_plan_trains_as_one_process(runs):
    steps = _assert_trains_as_one_process(runs, "fsdp2")
    for report in reports(runs["out"]["fsdp2"], "odc_run_rank"):
        assert report["engine"] is None and report["distributed_type"] == "DistributedType.FSDP", report
        assert report["odc_config"]["plan"] == "lockstep" and not report["odc_config"]["enable"], report
        assert report["odc_config"]["max_tokens_per_microbatch"] == 128, report
    assert "ODC on:" not in runs["procs"]["fsdp2"].stderr
    assert len(steps) == 2
    # 3 microbatches on each rank (the zero-weight one included) for 5 samples of one microbatch each
    assert all(step["odc/microbatches_min"] == step["odc/microbatches_max"] == 3 for step in steps), steps
