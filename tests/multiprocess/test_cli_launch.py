"""The ``odc-accelerate`` command line under real launches: 2 CPU processes, 2 optimizer steps, offline assets.

* ``odc-accelerate sft`` with no model and no dataset trains the offline default on the ``odc_cpu`` preset, with ODC.
* TRL's own, unmodified ``trl/scripts/sft.py`` (from the installed trl) trains WITH ODC under ``odc-accelerate launch
  --config_file`` a file written by ``odc-accelerate config --cpu --default``, on a local model folder and a local
  JSON-lines dataset (the offline default model and SFT data); the ``odc*`` keys of its ``--config`` recipe reach the
  ODC trainer (5 samples per step, so the ranks run unequal microbatch counts), and it trains as TRL's own
  ``SFTTrainer`` in one process on the same samples per step (the session's ``sft_reference``, fp32).
* A script whose trainer is a ``transformers.Seq2SeqTrainer`` subclass (which ODC does not support; a plain
  ``Trainer`` one trains with ODC, `test_integration_trainer.py`) stops before training under the same config.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from integration_utils import (
    SFT_PARITY,
    SFT_SAMPLES_PER_STEP,
    base_env,
    check_ok,
    logged_steps,
    max_rel,
    run,
    shm_leftovers,
)

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "odc_accelerate.cli"]
SMALL = ["--max_steps", "2", "--logging_steps", "1", "--report_to", "none", "--max_length", "128", "--seed", "0"]
SFT_SAMPLE = "Supervised fine-tuning through the command line."

# A script that trains a tiny model with a Seq2SeqTrainer subclass: under `odc: true` it must stop before training.
PLAIN_TRAINER_SCRIPT = """
import sys

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Seq2SeqTrainer, Seq2SeqTrainingArguments


class MyTrainer(Seq2SeqTrainer):
    pass


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = torch.arange(8) % 32
        return {"input_ids": ids, "labels": ids}


config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1)
args = Seq2SeqTrainingArguments(output_dir=sys.argv[1], max_steps=2, report_to="none", save_strategy="no")
trainer = MyTrainer(model=Qwen2ForCausalLM(config), args=args, train_dataset=Data())
trainer.train()
print("TRAINED WITHOUT ODC")
"""


def _timed(durations: dict, name: str, cmd: list, **env: str):
    start = time.perf_counter()
    proc = run(cmd, env=base_env(**env), timeout=400)
    durations[name] = time.perf_counter() - start
    return proc


def _odc_steps(state_file: Path) -> list[dict]:
    steps = [h for h in json.loads(state_file.read_text())["log_history"] if "loss" in h]
    assert len(steps) == 2, steps
    for step in steps:
        odc = {key for key in step if key.startswith("odc/")}
        assert {
            "odc/step_s",
            "odc/microbatches_min",
            "odc/microbatches_max",
            "odc/busy_s_max",
            "odc/wait_s_min",
        } <= odc, step
    return steps


def _assert_loads_trained(out: Path, initial: dict) -> None:
    """``out`` loads with ``from_pretrained`` (no missing or unexpected weights), with its tokenizer, and holds
    weights that training changed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    loaded = dict(model.named_parameters())
    assert loaded.keys() == initial.keys()
    assert all(torch.isfinite(p).all() for p in loaded.values())
    assert any(not torch.equal(loaded[name].detach(), initial[name]) for name in initial), "no weight changed"
    batch = AutoTokenizer.from_pretrained(out)(SFT_SAMPLE, return_tensors="pt")
    with torch.no_grad():
        assert torch.isfinite(model(**batch).logits).all()


def _offline_initial_weights() -> dict:
    """The offline default model before training, built as the SFT script builds it (``--seed 0``)."""
    import torch
    from transformers import AutoModelForCausalLM, set_seed

    from odc_accelerate.demo import tiny_qwen2_config

    set_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(), dtype=torch.float32)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sft_reference):
    import trl

    from odc_accelerate.demo import load_offline_tokenizer, offline_sft_dataset

    root = tmp_path_factory.mktemp("cli")
    durations: dict[str, float] = {}
    shm_before = shm_leftovers()
    env = {"HF_DATASETS_CACHE": str(root / "hf_datasets"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

    # local assets for TRL's script: a model folder with its tokenizer and a JSON-lines dataset, the offline default
    # model and SFT data that the one-process reference trains on
    initial = _offline_initial_weights()
    model_dir, data_dir = root / "model", root / "data"
    import torch
    from transformers import AutoModelForCausalLM

    from odc_accelerate.demo import tiny_qwen2_config

    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(), dtype=torch.float32)
    model.load_state_dict(initial)
    model.save_pretrained(model_dir)
    load_offline_tokenizer().save_pretrained(model_dir)
    data_dir.mkdir()
    with open(data_dir / "train.jsonl", "w") as f:
        for text in offline_sft_dataset()["text"]:
            f.write(json.dumps({"text": text}) + "\n")

    cfg = root / "odc.yaml"
    config = _timed(durations, "config", [*CLI, "config", "--cpu", "--default", "--config_file", cfg])
    procs = {"config": config}
    out = {name: root / name for name in ("sft", "trl_sft", "plain")}

    procs["sft"] = _timed(
        durations,
        "sft",
        [*CLI, "sft", *SMALL, "--main_process_port", "0", "--output_dir", out["sft"]],
        **env,
    )
    recipe = root / "recipe.yaml"
    recipe.write_text(
        f"odc_trace_dir: {root / 'trace'}\nodc_samples_per_step: {SFT_SAMPLES_PER_STEP}\nper_device_train_batch_size: 2\n"
    )
    trl_sft = Path(trl.__file__).parent / "scripts" / "sft.py"
    procs["trl_sft"] = _timed(
        durations,
        "trl_sft",
        [
            *CLI,
            "launch",
            "--config_file",
            cfg,
            "--main_process_port",
            "0",
            trl_sft,
            "--config",
            recipe,
            "--model_name_or_path",
            model_dir,
            "--dataset_name",
            data_dir,
            *SFT_PARITY,
            "--output_dir",
            out["trl_sft"],
        ],
        **env,
    )
    plain = root / "plain_trainer.py"
    plain.write_text(PLAIN_TRAINER_SCRIPT)
    procs["plain"] = _timed(
        durations,
        "plain",
        [*CLI, "launch", "--config_file", cfg, "--main_process_port", "0", plain, out["plain"]],
        **env,
    )
    print("launch times (s):", {name: round(s, 1) for name, s in durations.items()})
    return {
        "procs": procs,
        "out": out,
        "reference": sft_reference,
        "root": root,
        "cfg": cfg,
        "initial": initial,
        "shm_before": shm_before,
        "durations": durations,
    }


def test_sft_command_trains_the_offline_default_with_odc(runs):
    proc = runs["procs"]["sft"]
    check_ok(proc)
    assert "using the odc_cpu preset (no CUDA device found)" in proc.stderr
    out = runs["out"]["sft"]
    _odc_steps(out / "trainer_state.json")
    _assert_loads_trained(out, runs["initial"])


def test_trls_own_sft_script_trains_with_odc_under_launch_as_trl_in_one_process(runs):
    import torch
    from safetensors.torch import load_file

    proc = runs["procs"]["config"]
    check_ok(proc)
    assert f"wrote {runs['cfg']}" in proc.stdout
    proc = runs["procs"]["trl_sft"]
    check_ok(proc)
    out = runs["out"]["trl_sft"]
    # TRL's script saves no trainer state itself: the Trainer's final checkpoint holds it
    steps = _odc_steps(out / "checkpoint-2" / "trainer_state.json")
    # the recipe's odc_trace_dir reached the ODC trainer: each rank traced its 2 steps, and the logged microbatch
    # counts are the traced ones
    traced = []
    for rank in (0, 1):
        lines = (runs["root"] / "trace" / f"trace_rank{rank}.jsonl").read_text().splitlines()
        assert len(lines) == 2, lines
        traced.append([len(json.loads(line)["microbatches"]) for line in lines])
    for i, step in enumerate(steps):
        assert step["odc/microbatches_min"] == min(t[i] for t in traced) >= 1, (step, traced)
        assert step["odc/microbatches_max"] == max(t[i] for t in traced), (step, traced)
    # the recipe's odc_samples_per_step too: 5 samples per step, so the ranks ran unequal counts
    assert any(step["odc/microbatches_min"] != step["odc/microbatches_max"] for step in steps), steps
    _assert_loads_trained(out, runs["initial"])

    # Parity: TRL's SFTTrainer in one process, from the same weights, on the same 5 samples per optimizer step.
    reference, ref_out = runs["reference"]
    check_ok(reference)
    init = torch.load(ref_out / "initial_params.pt")
    assert max_rel(runs["initial"], init) == 0.0  # the model folder holds the reference's starting weights
    for a, b in zip(logged_steps(out / "checkpoint-2"), logged_steps(ref_out), strict=True):
        # the exact per-token mean over the global batch, and the tokens of every rank
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)  # fp32 summation order
        assert a["num_tokens"] == b["num_tokens"]
    # the full weights TRL's script saved, against the reference's: equal up to fp32 summation order, a tiny fraction
    # of the update itself
    trained, expected = load_file(out / "model.safetensors"), torch.load(ref_out / "final_params.pt")
    diff = sum(float((trained[k] - expected[k]).norm() ** 2) for k in expected) ** 0.5
    update = sum(float((expected[k] - init[k]).norm() ** 2) for k in expected) ** 0.5
    assert update > 0 and diff / update <= 1e-4, (diff, update)
    assert max_rel(trained, expected) <= 1e-4


def test_a_seq2seq_trainer_subclass_stops_before_training(runs):
    proc = runs["procs"]["plain"]
    assert proc.returncode != 0
    assert "TRAINED WITHOUT ODC" not in proc.stdout
    assert "This run asks for ODC, but the script trains with __main__.MyTrainer, which is not an ODC trainer" in (
        proc.stderr
    )
    assert "ODC does not support transformers' Seq2SeqTrainer" in proc.stderr
    assert not (runs["out"]["plain"] / "checkpoint-1").exists()


def test_no_shared_memory_left(runs):
    assert shm_leftovers() <= runs["shm_before"]
