"""Streamed training sets (``--dataset_streaming true``: a `datasets.IterableDataset`) with the balanced step plans,
through the SFT and DPO examples under real `accelerate launch`, 2 CPU processes, local JSON-lines files.

Module-scoped runs:

* ``sft_odc``: ``--odc true``, free plan, 5 samples per step from a 13-sample stream: the ranks run different
  microbatch counts; steps 1-2 are the stream's first pass (its last 3 samples are dropped), step 3 opens the second
  pass; a checkpoint at step 2.
* ``sft_plain``: one plain process (the Trainer's own data path, batches of 5 read in stream order): the ground truth
  for the samples and the exact loss of steps 1-2.
* ``sft_resumed``: ``sft_odc`` resumed from its checkpoint-2 (skips the whole first pass, trains step 3).
* ``dpo_lockstep`` / ``dpo_plain``: DPO with ODC and the lockstep plan (4 pairs per step) against one plain process
  reading the same stream in batches of 4.

Errors raised before training (or at the step that breaks the budget) are checked in one process, on the trainer;
the ranks' agreement on the stream's first step on 2 real gloo ranks.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from integration_utils import (
    CONFIGS,
    ROOT,
    RUN_EXAMPLE,
    TRAIN,
    accelerate_launch,
    assert_dpo_metrics_match,
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

DPO_CONFIGS = ROOT / "examples" / "dpo" / "configs"
DPO_TRAIN = ROOT / "examples" / "dpo" / "train.py"

COMMON = [
    "--logging_steps",
    "1",
    "--report_to",
    "none",
    "--max_length",
    "64",
    "--odc_max_tokens_per_microbatch",
    "128",
    "--optim",
    "sgd",
    # SGD with momentum: the checkpoint holds an optimizer state the resume reads back (see test_integration_sft.py)
    "--optim_args",
    "momentum=0.9",
    "--seed",
    "0",
    "--dataloader_pin_memory",
    "false",
    "--dataset_streaming",
    "true",
]
SFT = [*COMMON, "--learning_rate", "0.5"]
DPO = [*COMMON, "--learning_rate", "0.2", "--max_steps", "2", "--save_strategy", "no"]
SFT_ROWS = 13  # 2 steps of 5 per pass, 3 samples dropped
DUMP = {"ODC_DUMP_PARAMS": "1"}


def _write_jsonl(folder, rows):
    folder.mkdir()
    with open(folder / "train.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from odc_accelerate.demo import offline_preference_pairs, offline_texts

    root = tmp_path_factory.mktemp("streaming")
    shm_before = shm_leftovers()
    # short texts of varied lengths (16 to 137 tokens, truncated to 64)
    sft_data = _write_jsonl(root / "sft_data", [{"text": t} for t in offline_texts(60, 4)[:SFT_ROWS]])
    dpo_data = _write_jsonl(root / "dpo_data", offline_preference_pairs(60)[:10])
    names = ("sft_odc", "sft_plain", "sft_resumed", "dpo_lockstep", "dpo_plain")
    out = {name: root / name for name in names}
    procs = {}
    sft_odc = [*SFT, "--dataset_name", sft_data, "--odc_samples_per_step", "5", "--max_steps", "3"]
    procs["sft_odc"] = background(
        accelerate_launch,
        CONFIGS / "odc_cpu.yaml",
        TRAIN,
        "--odc",
        "true",
        *sft_odc,
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
        "--output_dir",
        out["sft_odc"],
        ODC_TRACE_DIR=str(out["sft_odc"] / "trace"),
        **DUMP,
    )
    plain = ["--per_device_train_batch_size", "5", "--max_steps", "2", "--save_strategy", "no"]
    procs["sft_plain"] = background(
        run,
        [
            sys.executable,
            RUN_EXAMPLE,
            TRAIN,
            *SFT,
            "--dataset_name",
            sft_data,
            *plain,
            "--output_dir",
            out["sft_plain"],
        ],
        env=base_env(**DUMP),
    )
    if procs["sft_odc"].result().returncode == 0:  # the resumed run starts from its checkpoint
        procs["sft_resumed"] = background(
            accelerate_launch,
            CONFIGS / "odc_cpu.yaml",
            TRAIN,
            "--odc",
            "true",
            *sft_odc,
            "--save_strategy",
            "no",
            "--resume_from_checkpoint",
            out["sft_odc"] / "checkpoint-2",
            "--output_dir",
            out["sft_resumed"],
            **DUMP,
        )
    procs["dpo_lockstep"] = background(
        accelerate_launch,
        DPO_CONFIGS / "odc_cpu.yaml",
        DPO_TRAIN,
        "--odc",
        "true",
        "--odc_plan",
        "lockstep",
        *DPO,
        "--dataset_name",
        dpo_data,
        "--per_device_train_batch_size",
        "2",
        "--output_dir",
        out["dpo_lockstep"],
        **DUMP,
    )
    procs["dpo_plain"] = background(
        run,
        [
            sys.executable,
            RUN_EXAMPLE,
            DPO_TRAIN,
            *DPO,
            "--dataset_name",
            dpo_data,
            "--per_device_train_batch_size",
            "4",
            "--output_dir",
            out["dpo_plain"],
        ],
        env=base_env(**DUMP),
    )
    return {"out": out, "procs": results(procs), "shm_before": shm_before}


def _tokens_per_step(out) -> list[float]:
    """Input tokens of each logged step (``num_tokens`` is cumulative over the run)."""
    seen = [h["num_tokens"] for h in logged_steps(out)]
    return [b - a for a, b in zip([0.0, *seen[:-1]], seen, strict=True)]


def test_streamed_sft_trains_the_streams_chunks_with_the_exact_loss(runs):
    check_ok(runs["procs"]["sft_odc"])
    check_ok(runs["procs"]["sft_plain"])
    odc, plain = runs["out"]["sft_odc"], runs["out"]["sft_plain"]
    ranks = reports(odc, "odc_run_rank")
    assert [r["engine"] for r in ranks] == ["ODCEngine", "ODCEngine"]
    assert reports(plain, "odc_run_rank")[0]["odc_config"]["plan"] is None  # the Trainer's own data path
    history = logged_steps(odc)
    assert [h["step"] for h in history] == [1, 2, 3]
    # 5 samples over 2 ranks, free plan: the ranks run different numbers of microbatches
    assert all(h["odc/microbatches_min"] < h["odc/microbatches_max"] for h in history)
    # Steps 1-2: the same samples as the plain run's batches of 5 in stream order, and the same per-token mean loss
    for a, b in zip(history[:2], logged_steps(plain), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["mean_token_accuracy"] == pytest.approx(b["mean_token_accuracy"], abs=1e-6)
        assert a["num_tokens"] == b["num_tokens"]
    # Step 3 opens the second pass: the first 5 samples again (the first pass's last 3 were dropped)
    tokens = _tokens_per_step(odc)
    assert tokens[2] == tokens[0] != tokens[1]
    assert shm_leftovers() <= runs["shm_before"], "shared memory left behind"


def test_streamed_sft_resumes_exactly_across_the_pass_boundary(runs):
    check_ok(runs["procs"]["sft_odc"])
    check_ok(runs["procs"]["sft_resumed"])
    odc, resumed = runs["out"]["sft_odc"], runs["out"]["sft_resumed"]
    assert (odc / "checkpoint-2").is_dir()
    after = logged_steps(resumed)
    assert [h["step"] for h in after] == [1, 2, 3]  # steps 1-2 come from the checkpoint's history
    # step 3 trains the same samples in the same microbatches as the uninterrupted run
    new, last = after[-1], logged_steps(odc)[-1]
    assert new["loss"] == pytest.approx(last["loss"], rel=1e-6)
    # TRL's running token count is not in the checkpoint (it restarts at 0): the resumed run counts step 3 alone
    assert new["num_tokens"] == _tokens_per_step(odc)[2]
    assert new["odc/microbatches_min"] == last["odc/microbatches_min"]
    assert new["odc/microbatches_max"] == last["odc/microbatches_max"]
    assert max_rel(final_params(resumed), final_params(odc)) <= 1e-6


def test_streamed_dpo_with_the_lockstep_plan_matches_one_plain_process(runs):
    check_ok(runs["procs"]["dpo_lockstep"])
    check_ok(runs["procs"]["dpo_plain"])
    odc, plain = runs["out"]["dpo_lockstep"], runs["out"]["dpo_plain"]
    ranks = reports(odc, "odc_run_rank")
    assert [r["engine"] for r in ranks] == ["ODCEngine", "ODCEngine"]
    assert all(r["odc_config"]["plan"] == "lockstep" and r["reference_engine"] for r in ranks)
    history = logged_steps(odc)
    assert [h["step"] for h in history] == [1, 2]
    for a, b in zip(history, logged_steps(plain), strict=True):
        assert a["odc/microbatches_min"] == a["odc/microbatches_max"]  # lockstep: the same count on every rank
        # the mean over every pair of the step, and DPO's metrics of the whole step
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert_dpo_metrics_match(a, b)
        assert a["num_tokens"] == b["num_tokens"]
    assert logged_steps(plain)[1]["rewards/margins"] != 0.0  # step 2 trained on moved weights
    a, b, init = final_params(odc), final_params(plain), torch.load(plain / "initial_params.pt")
    diff = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    update = sum(float((b[k] - init[k]).norm() ** 2) for k in b) ** 0.5
    assert update > 0 and diff / update <= 1e-4, (diff, update)


# One process builds ODC SFT trainers on small streams and reports what each raises (no training needed).
_ERRORS = r"""
import json, sys
from datasets import Dataset
from transformers import AutoModelForCausalLM
from odc_accelerate.demo import load_offline_tokenizer, offline_texts, tiny_qwen2_config
from odc_accelerate.integrations.trl import ODCSFTConfig, ODCSFTTrainer

tokenizer = load_offline_tokenizer()
model = AutoModelForCausalLM.from_config(tiny_qwen2_config())
texts = sorted(offline_texts(60, 4)[:40], key=len)  # short first: the longest samples come in later steps


def loader(rows, **overrides):
    kwargs = dict(output_dir=sys.argv[1], odc_plan="free", odc_samples_per_step=4, max_steps=2, report_to="none",
                  max_length=64, odc_max_tokens_per_microbatch=128)
    kwargs.update(overrides)
    stream = Dataset.from_dict({"text": rows}).to_iterable_dataset()
    trainer = ODCSFTTrainer(model=model, args=ODCSFTConfig(**kwargs), train_dataset=stream, processing_class=tokenizer)
    return trainer.get_train_dataloader()


def error(make):
    try:
        make()
    except (ValueError, RuntimeError) as err:
        return str(err)
    return None


def steps_until_error(data):
    n = 0
    for _ in data:
        n += 1
    return n


out = {
    "no_budget": error(lambda: loader(texts, max_length=None, odc_max_tokens_per_microbatch=None)),
    "workers": error(lambda: loader(texts, dataloader_num_workers=2)),
    "short": error(lambda: loader(texts[:3])),
    "late_long_sample": error(lambda: steps_until_error(loader(texts, max_length=None, odc_max_tokens_per_microbatch=40))),
    "first_steps": [[list(mb["input_ids"].shape) for mb in step] for _, step in zip(range(3), loader(texts))],
}
print(json.dumps(out))
"""


def test_streaming_errors_say_what_to_change(tmp_path):
    proc = run([sys.executable, "-c", _ERRORS, tmp_path], env=base_env())
    check_ok(proc)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "Set --odc_max_tokens_per_microbatch, or set --max_length" in out["no_budget"]
    assert "Set --dataloader_num_workers 0 (it is 2)" in out["workers"]
    assert "The training stream has 3 sample(s), fewer than the 4 samples of one optimizer step" in out["short"]
    # samples are checked against the budget step by step: the error names the step that breaks it
    late = out["late_long_sample"]
    assert late.startswith("Training stream, optimizer step ") and not late.startswith(
        "Training stream, optimizer step 1:"
    )
    assert "smaller than the longest sample" in late
    assert "Raise --odc_max_tokens_per_microbatch" in late
    # the working stream yields whole steps: 4 samples each (odc_samples_per_step), in padded microbatches that
    # hold at most the token budget (128)
    assert len(out["first_steps"]) == 3
    for step in out["first_steps"]:
        assert sum(rows for rows, _ in step) == 4, step
        assert all(rows * length <= 128 for rows, length in step), step


def _first_step_on_each_rank(rank: int, world_size: int) -> dict:
    """Each rank reads the first step of several streams as the trainer does before training; what each case gives."""
    import types

    import torch.distributed as dist
    from datasets import Dataset
    from datasets.distributed import split_dataset_by_node

    from odc_accelerate.integrations.trainer.mixin import ODCTrainerMixin
    from odc_accelerate.planning import dataset_lengths

    def gather(tensor):
        parts = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.all_gather(parts, tensor)
        return torch.cat(parts)

    # The trainer's attributes the first-step check reads; the collective is a real all-gather between the ranks.
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(num_processes=world_size, gather=gather),
        args=types.SimpleNamespace(remove_unused_columns=False, device=torch.device("cpu")),
        _odc_lengths=dataset_lengths,
    )

    class Unreadable:
        def __iter__(self):
            raise OSError("cannot open the shard")

    rows = Dataset.from_dict({"input_ids": [[1] * (i + 1) for i in range(12)]})
    streams = {
        "same": rows.to_iterable_dataset(num_shards=2),
        "split_by_rank": split_dataset_by_node(rows.to_iterable_dataset(num_shards=2), rank, world_size),
        "rank1_unreadable": Unreadable() if rank == 1 else rows.to_iterable_dataset(),
        "short": rows.select(range(3)).to_iterable_dataset(),
    }
    out = {}
    for name, stream in streams.items():
        try:
            _, lengths = ODCTrainerMixin._odc_stream_first_step(trainer, stream, 4)
            out[name] = lengths.tolist()
        except Exception as err:  # noqa: BLE001 - the test reads every rank's error
            out[name] = f"{type(err).__name__}: {err}"
    return out


def test_ranks_agree_on_the_first_step_or_all_stop():
    from odc_accelerate.testing import launch

    results = launch(_first_step_on_each_rank, 2, timeout=120)
    assert [r["same"] for r in results] == [[1, 2, 3, 4]] * 2
    for r in results:  # every rank stops with the same message: none is left waiting in a collective
        assert r["split_by_rank"].startswith("ValueError: The ranks read different samples"), r
        assert "split_dataset_by_node" in r["split_by_rank"] and "shuffle(seed=" in r["split_by_rank"]
        assert r["short"].startswith("ValueError: The training stream has 3 sample(s), fewer than the 4"), r
    assert results[1]["rank1_unreadable"] == "OSError: cannot open the shard"
    assert results[0]["rank1_unreadable"].startswith("RuntimeError: Rank(s) [1] could not read the first step")
