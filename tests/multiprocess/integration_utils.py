"""Helpers for the integration tests: real `accelerate launch` / `odc-accelerate launch` runs on 2 CPU processes."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.infra import warm_start

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "sft" / "configs"
TRAIN = ROOT / "examples" / "sft" / "train.py"
LOOP = ROOT / "tests" / "helpers" / "loops" / "accelerate_loop.py"
# Examples run unchanged; this wrapper adds the run reports, call counts and parameter dumps the tests read.
RUN_EXAMPLE = ROOT / "tests" / "helpers" / "loops" / "run_example.py"


def base_env(*, warm: bool = True, **extra: str) -> dict[str, str]:
    """The environment of a launched job: this process's without ODC / accelerate settings, one thread per rank,
    the repository importable, and ``extra``. With ``warm``, its Python processes start as forks of the session's
    warm-start server (`tests/helpers/infra/warm_start.py`) when it runs."""
    env = plain_env(**extra)
    return warm_start.env(env) if warm else env


def plain_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for key in list(env):
        if key.startswith(("ODC_", "ACCELERATE_", "FSDP_")) and key not in ("ODC_CACHE", "ODC_OFFLINE_BPE_RANKS"):
            env.pop(key)
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT), **extra)
    return env


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 300.0) -> subprocess.CompletedProcess:
    # No job reads its standard input; /dev/null keeps it open whatever the session's is (a warm start hands the
    # standard streams over and starts fresh where one is closed).
    return subprocess.run(
        [str(c) for c in cmd],
        cwd=ROOT,
        env=env or base_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# Jobs started with `background` that may run at the same time. One 2-rank job leaves much of 2 cores idle (start-up,
# rendezvous, saving; a one-process reference run uses one core), so two at a time fill them; more would only slow
# each one down. ODC_TEST_JOBS=1 runs them one after the other.
_SLOTS = threading.BoundedSemaphore(max(1, int(os.environ.get("ODC_TEST_JOBS", "2"))))


def background(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """Call ``fn(*args, **kwargs)`` (a blocking job: `run`, `accelerate_launch`, `trl_reference`...) in a thread once
    one of the ``ODC_TEST_JOBS`` slots is free (this call waits for it); its future. A module's independent runs go
    through it, and `results` collects them."""
    _SLOTS.acquire()
    future: Future = Future()

    def job() -> None:
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:  # re-raised by future.result() in the test's thread
            future.set_exception(err)
        finally:
            _SLOTS.release()

    threading.Thread(target=job, daemon=True).start()
    return future


def results(jobs: dict[str, Any]) -> dict[str, Any]:
    """``jobs`` with every `background` future replaced by its result (waiting for each)."""
    return {name: job.result() if isinstance(job, Future) else job for name, job in jobs.items()}


TRL_REFERENCE = ROOT / "tests" / "helpers" / "loops" / "trl_reference.py"


def trl_reference(trainer: str, samples_per_step: int, *args: str, output_dir: Path) -> subprocess.CompletedProcess:
    """TRL's own ``trainer`` ("sft" / "dpo") in one process on the same optimizer steps as an ODC run with
    ``--odc_samples_per_step samples_per_step`` (`tests/helpers/loops/trl_reference.py`); ``args`` are the ODC run's
    arguments, whose ``--odc*`` options (and their values) are left out."""
    kept = _without_odc_options(args)
    cmd = [sys.executable, TRL_REFERENCE, trainer, "--samples_per_step", str(samples_per_step), *kept]
    return run([*cmd, "--output_dir", output_dir])


def _without_odc_options(args: Sequence[str]) -> list[str]:
    """``args`` without the ``--odc*`` options and their values (what `trl_reference` leaves out)."""
    kept, skip = [], False
    for arg in map(str, args):
        if skip:
            skip = False
        elif arg.startswith("--odc"):
            skip = "=" not in arg
        else:
            kept.append(arg)
    return kept


def _settings(args: Sequence[str]) -> tuple[tuple[str, str | None], ...]:
    """The settings ``args`` give a trainer (``--key value`` or ``--key=value``; a bare flag has None; a later value
    wins, as with HfArgumentParser), sorted: equal for argument lists that configure the same run."""
    settings: dict[str, str | None] = {}
    args = list(args)
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        key, eq, value = arg.partition("=")
        if eq:
            settings[key] = value
        else:
            following = args[i + 1] if i + 1 < len(args) else None
            settings[key] = None if following is None or following.startswith("--") else following
    return tuple(sorted(settings.items()))


class References:
    """TRL's own trainer in one process (`trl_reference`), run once per session for each distinct run: the parity
    tests of several modules (SFT and DPO, plain and HSDP, static and dynamic plans) compare with the same reference
    runs, which differ only in the ``--odc*`` options the reference leaves out."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._runs: dict[tuple, tuple[Future, Path]] = {}

    def start(self, trainer: str, samples_per_step: int, *args: str) -> tuple[Future, Path]:
        """The reference run of ``trainer`` on ``args`` (the ODC run's arguments): started in the `background` unless
        an equal one already ran or runs; its future (the completed process) and output folder."""
        key = (trainer, samples_per_step, _settings(_without_odc_options(args)))
        if key not in self._runs:
            out = self._root / f"{trainer}{len(self._runs)}"
            self._runs[key] = (background(trl_reference, trainer, samples_per_step, *args, output_dir=out), out)
        return self._runs[key]


# The SFT parity runs' arguments (2 steps of SGD with momentum, fp32): ODC runs take them with
# ``--odc_samples_per_step SFT_SAMPLES_PER_STEP``; `sft_reference` (conftest.py) is TRL's trainer in one process on them.
SFT_PARITY = [
    "--max_steps", "2", "--logging_steps", "1", "--report_to", "none", "--max_length", "128",
    "--odc_max_tokens_per_microbatch", "128",
    # SGD with momentum has an optimizer state: torch loads a FULL_STATE_DICT optimizer checkpoint only when the
    # optimizer has one (plain SGD fails with "Expected device to be set"), and the resume test reads it back
    "--optim", "sgd", "--optim_args", "momentum=0.9", "--learning_rate", "0.5",
    "--seed", "0", "--dataloader_pin_memory", "false",
]  # fmt: skip
SFT_SAMPLES_PER_STEP = 5

# GRPO's gradient norm against one process: the KL term (beta > 0) compares the policy's log-probs with the reference
# model's, computed in other batches than one process computes them, so fp32 noise d enters as exp(d) - d - 1 >= 0
# and adds a noise vector to the gradient, whose norm then comes out slightly larger (by |noise|^2 / 2|g|) on every
# run: measured +0.8e-6 to +2.7e-6 relative with Qwen's full vocabulary, +0.8e-5 to +1.0e-5 with the suite's 8,192
# ranks (a smaller softmax, larger per-token gradients). The control without the KL term (beta=0,
# test_integration_grpo.py) is held to 1e-5; it measured +0.85e-5 too, as did the first step with beta > 0 (where the
# KL term is exactly 0): most of that excess comes from elsewhere than the KL term.
GRPO_GRAD_NORM_REL = 5e-5


# DPO's rewards against one process. A reward is beta * (policy log-prob sum - reference log-prob sum), both sums over
# a few hundred tokens in fp32. Another batching sums them in another order, so each sum carries noise of order one ulp
# of its magnitude (|logps|, ~150-300 here), and the reward carries beta times that: an absolute noise that does not
# shrink with the reward. Measured: up to 0.4 ulp of |logps| (1.1e-6 on a reward of 0.011 with |logps| 246, beta
# 0.1). The bound below is 2 ulps; a relative bound on the reward itself would flake whenever the reward is small.
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen")
DPO_BETA = 0.1  # TRL's default, which the suite's DPO runs keep
_FP32_ULP = 2.0**-23


def assert_dpo_metrics_match(a: dict, b: dict, keys: tuple[str, ...] = DPO_METRICS) -> None:
    """Asserts that the DPO metrics of one logged step ``a`` match the reference step ``b`` to fp32 noise."""
    magnitude = max(abs(b["logps/chosen"]), abs(b["logps/rejected"]))
    reward_noise = DPO_BETA * 2 * _FP32_ULP * magnitude
    for key in keys:
        if key.startswith("rewards/") and key != "rewards/accuracies":
            # a margin is the difference of two rewards: twice the noise of one
            bound = 2 * reward_noise if key == "rewards/margins" else reward_noise
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=bound), key
        else:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


# The models the parity runs train besides the offline default (tiny untied Qwen2): a tied one and a mixture of experts,
# saved by the session's `tiny_model` fixture (conftest.py) and passed with --model_name_or_path.
MODEL_KINDS = ("untied", "tied", "moe")
# The hybrid linear-attention MoE (Qwen3.5 / 3.6 shape): its Gated DeltaNet layers run transformers' slow PyTorch
# fallback on CPU, so the modules give it one short step of their own, not every case of MODEL_KINDS.
HYBRID = "hybrid"


# The router's auxiliary-loss coefficient of the MoE runs that train with it: far above TRL's default (0.001 for
# Qwen3-MoE), so that its term is a visible part of the update and a wrong weighting of it shows.
MOE_AUX_COEF = 1.0


def model_args(tiny_model: Callable[..., Path], kind: str, hidden_size: int = 64, aux: float = 0.0) -> list[str]:
    """The script arguments that train the ``kind`` model (one of `MODEL_KINDS`; none for the offline default). The
    MoE model trains with its router's auxiliary loss at coefficient ``aux`` (0: without it, whose weighting under a
    plan other runs check: `odc_accelerate.integrations.trainer.moe`)."""
    if kind == "untied":
        return []
    args = ["--model_name_or_path", str(tiny_model(kind, hidden_size))]
    if kind == HYBRID:
        return [*args, "--router_aux_loss_coef", "0"]
    return [*args, "--router_aux_loss_coef", f"{aux:g}"] if kind == "moe" else args


def accelerate_launch(config: str | Path, script: Path, *args: str, launcher: str = "accelerate", **env: str):
    head = (
        [sys.executable, "-m", "accelerate.commands.launch"]
        if launcher == "accelerate"
        else [sys.executable, "-m", "odc_accelerate.launch", "launch"]
    )
    wrapper = [RUN_EXAMPLE] if Path(script).resolve().is_relative_to(ROOT / "examples") else []
    return run(
        [*head, "--config_file", config, "--main_process_port", "0", *wrapper, script, *args], env=base_env(**env)
    )


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
    )
    assert "Aborted" not in proc.stderr and "SIGABRT" not in proc.stderr, proc.stderr[-4000:]


def reports(out: Path, prefix: str) -> list[dict]:
    return [json.loads(Path(p).read_text()) for p in sorted(glob.glob(str(out / f"{prefix}*.json")))]


def shm_leftovers() -> set[str]:
    return {p for p in glob.glob("/dev/shm/odc_*")}


def logged_steps(out: Path) -> list[dict]:
    """The logged training steps (rows with a loss) of a run's ``trainer_state.json``."""
    state = json.loads((out / "trainer_state.json").read_text())
    return [h for h in state["log_history"] if "loss" in h]


def final_params(out: Path) -> dict:
    """The full final weights rank 0 saved (``ODC_DUMP_PARAMS=1`` through ``run_example.py``)."""
    import torch

    return torch.load(out / "final_params.pt")


def max_rel(a: dict, b: dict) -> float:
    """Largest per-tensor max-abs difference of ``a`` from ``b``, relative to ``b``'s max-abs value."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / (b[k].abs().max() + 1e-12)) for k in a)


def assert_same_logits(model, reference, out: Path, sentence: str) -> None:
    """``model`` and ``reference`` give the same logits on ``sentence``, tokenized by the tokenizer saved in ``out``
    (which must tokenize as the offline tokenizer does)."""
    import torch
    from transformers import AutoTokenizer

    from odc_accelerate.demo import load_offline_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)  # saved with the model
    batch = tokenizer(sentence, return_tensors="pt")
    assert batch["input_ids"][0].tolist() == load_offline_tokenizer()(sentence)["input_ids"]
    with torch.no_grad():
        logits, expected = model.eval()(**batch).logits, reference.eval()(**batch).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def assert_saved_model_is_the_trained_one(out: Path, sentence: str, kind: str = "untied") -> None:
    """``out`` loads with ``from_pretrained`` (no missing or unexpected weights), holds exactly the final weights
    (``final_params.pt``) and gives the logits of the model of ``kind`` (`MODEL_KINDS`) built from its config with
    them. A tied model's saved file holds the LM head only as the input embedding (or as an equal copy of it), and
    it loads tied."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from odc_accelerate.testing.models import tiny_causal_lm_config

    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    trained = final_params(out)
    loaded = {name: p.detach() for name, p in model.named_parameters()}
    assert loaded.keys() == trained.keys()
    for name, expected in trained.items():
        assert torch.equal(loaded[name], expected), name
    reference = AutoModelForCausalLM.from_config(tiny_causal_lm_config(kind), dtype=torch.float32)
    # named_parameters lists a tied weight once (under the input embedding's name); the state dict has both names
    missing, unexpected = reference.load_state_dict(trained, strict=False)
    tied = kind == "tied"
    assert not unexpected and missing == (["lm_head.weight"] if tied else []), (missing, unexpected)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) is tied
    if tied:  # the file itself: no LM head apart from the trained embedding
        saved = load_file(out / "model.safetensors")
        embedding = saved["model.embed_tokens.weight"]
        assert torch.equal(embedding, trained["model.embed_tokens.weight"])
        assert torch.equal(saved.get("lm_head.weight", embedding), embedding)
    assert_same_logits(model, reference, out, sentence)
