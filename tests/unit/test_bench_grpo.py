"""GRPO benchmark (``python -m benchmarks.grpo``): the figures follow from the trainer's own log, by hand-computed
examples; ratios are taken within each repeat, each arm's over FSDP2 running the same trainer (GRPO or RLOO); every arm
gets the same sizes; the RLOO arms' completions stop at the GRPO arms' target lengths; every output file is written.
Timings are never asserted."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from benchmarks.grpo.aggregate import aggregate
from benchmarks.grpo.arms import ARMS, RLOO_ARMS, baseline_of
from benchmarks.grpo.cli import parse_args
from benchmarks.grpo.records import make_record, parse_log_history, summarize_run
from benchmarks.grpo.report import write_outputs
from benchmarks.grpo.runner import arm_order, command
from tests.conftest import requires_trl_116

ROOT = Path(__file__).resolve().parents[2]


def _row(step, step_s, tokens, busy, wait, gen, lengths=(40.0, 120.0), reward=0.5, mbs=(1, 1), scale=1.0) -> dict:
    """A log_history row as ODCGRPOTrainer logs it (every time multiplied by ``scale``)."""
    row = {"step": step, "loss": 0.01, "reward": reward, "odc/step_s": step_s * scale}
    row["odc/tokens_per_s"] = tokens / (step_s * scale)
    row["odc/bubble_pct"] = 0.0  # not read back: the run's bubble comes from busy and step times
    row["odc/microbatches_min"], row["odc/microbatches_max"] = mbs
    row["completions/mean_length"], row["completions/max_length"] = lengths
    for r, (b, w, g) in enumerate(zip(busy, wait, gen, strict=True)):
        row[f"odc/busy_s_rank{r}"], row[f"odc/wait_s_rank{r}"] = b * scale, w * scale
        row[f"odc/generation_s_rank{r}"] = g * scale
    return row


def _fsdp2_history(scale: float = 1.0) -> list[dict]:
    return [
        # warm-up: dropped (its 250-token completion must not be the run's longest)
        _row(1, 20.0, 200, [18.0, 18.0], [2.0, 2.0], [10.0, 10.0], lengths=(80.0, 250.0), scale=scale),
        _row(2, 10.0, 1000, [8.0, 6.0], [2.0, 4.0], [5.0, 5.0], lengths=(40.0, 120.0), reward=0.5, scale=scale),
        _row(3, 14.0, 700, [12.0, 10.0], [2.0, 4.0], [7.0, 7.0], lengths=(60.0, 200.0), reward=0.7, scale=scale),
        {"step": 3, "train_runtime": 50.0, "train_loss": 0.01},  # the trainer's closing row: not a step
    ]


def _odc_history(scale: float = 1.0) -> list[dict]:
    return [
        _row(1, 15.0, 200, [14.0, 13.0], [1.0, 2.0], [9.0, 4.0], lengths=(80.0, 250.0), mbs=(1, 1), scale=scale),
        _row(2, 8.0, 1000, [7.5, 7.6], [0.5, 0.4], [5.0, 2.0], lengths=(40.0, 120.0), mbs=(1, 2), scale=scale),
        _row(3, 12.0, 700, [11.6, 11.0], [0.4, 1.0], [7.0, 3.0], lengths=(60.0, 200.0), mbs=(2, 3), scale=scale),
    ]


def test_a_run_summary_matches_hand_computed_figures():
    steps = parse_log_history(_fsdp2_history())
    assert [s["step"] for s in steps] == [1, 2, 3]  # the closing row is no step
    assert steps[1]["tokens"] == 1000 and steps[2]["tokens"] == 700
    assert steps[1]["generation_s"] == [5.0, 5.0] and steps[1]["training_s"] == pytest.approx([3.0, 1.0])
    s = summarize_run(steps, warmup=1)
    assert s["steps_measured"] == 2
    assert s["step_s"] == pytest.approx(12.0)  # (10 + 14) / 2
    assert s["tokens_per_s"] == pytest.approx(1700 / 24)
    assert s["generation_s"] == pytest.approx([6.0, 6.0])
    assert s["training_s"] == pytest.approx([4.0, 2.0])  # busy - generation: (3 + 5) / 2, (1 + 3) / 2
    assert s["wait_s"] == pytest.approx([2.0, 4.0])
    assert s["generation_max_s"] == pytest.approx(6.0)
    assert s["bubble_pct"] == pytest.approx(25.0)  # 1 - (7 + 11) / 24
    assert s["completion_mean_length"] == pytest.approx(50.0) and s["completion_max_length"] == 200.0
    assert s["reward"] == pytest.approx(0.6)

    odc = summarize_run(parse_log_history(_odc_history()), warmup=1)
    assert odc["generation_s"] == pytest.approx([6.0, 2.5])
    assert odc["training_s"] == pytest.approx([3.55, 6.8])  # (2.5 + 4.6) / 2, (5.6 + 8) / 2
    # per step the slowest rank: max(5, 2) and max(7, 3)
    assert odc["generation_max_s"] == pytest.approx(6.0)
    assert odc["bubble_pct"] == pytest.approx(100 * (1 - (7.55 + 11.3) / 20))
    assert odc["microbatches_min_max"] == [1, 3]
    with pytest.raises(ValueError, match="raise --max_steps"):
        summarize_run(steps, warmup=3)
    # a long third measured step: the run's figures are means over steps (same prompts in both arms), not medians
    longer = parse_log_history([*_fsdp2_history()[:3], _row(4, 30.0, 300, [29.0, 28.0], [1.0, 2.0], [20.0, 20.0])])
    s = summarize_run(longer, warmup=1)
    assert s["step_s"] == pytest.approx(18.0) and s["step_s_median"] == pytest.approx(14.0)
    assert s["tokens_per_s"] == pytest.approx(2000 / 54)
    assert s["generation_max_s"] == pytest.approx(32 / 3)  # (5 + 7 + 20) / 3
    assert s["training_s"] == pytest.approx([17 / 3, 4.0])  # (3 + 5 + 9) / 3, (1 + 3 + 8) / 3


def test_a_log_without_generation_times_is_refused():
    row = _row(1, 2.0, 100, [1.0, 1.0], [1.0, 1.0], [0.5, 0.5])
    del row["odc/generation_s_rank1"]
    with pytest.raises(ValueError, match="odc/generation_s_rank1"):
        parse_log_history([row])


FSDP2_SCALES = (1.0, 1.5, 1.2)  # repeat -> every time of the run multiplied by this (machine noise)
ODC_SCALES = (0.9, 1.0, 1.3)


def _runs() -> dict[str, list[dict]]:
    runs = {
        "fsdp2": [
            make_record("fsdp2", parse_log_history(_fsdp2_history(f)), [900.0, 910.0 + rep], 1, rep)
            for rep, f in enumerate(FSDP2_SCALES)
        ],
        "odc": [
            make_record("odc", parse_log_history(_odc_history(g)), [950.0, 940.0], 1, rep)
            for rep, g in enumerate(ODC_SCALES)
        ],
    }
    runs["odc"].reverse()  # paired by repeat, not by position
    return runs


def test_medians_over_repeats_and_ratios_within_each_repeat():
    result = aggregate(_runs())
    fsdp2, odc = result["arms"]["fsdp2"], result["arms"]["odc"]
    # run step times: FSDP2 12 x (1, 1.5, 1.2) = 12, 18, 14.4; ODC 10 x (0.9, 1, 1.3) = 9, 10, 13
    assert fsdp2["step_s_runs"] == pytest.approx([12.0, 18.0, 14.4])
    assert fsdp2["step_s"] == pytest.approx(14.4) and odc["step_s"] == pytest.approx(10.0)
    assert fsdp2["tokens_per_s"] == pytest.approx(1700 / (24 * 1.2))  # 59.0: the median repeat's
    assert fsdp2["generation_s"] == pytest.approx([7.2, 7.2])
    assert fsdp2["training_s"] == pytest.approx([4.8, 2.4]) and fsdp2["wait_s"] == pytest.approx([2.4, 4.8])
    assert odc["generation_s"] == pytest.approx([6.0, 2.5]) and odc["training_s"] == pytest.approx([3.55, 6.8])
    assert odc["wait_s"] == pytest.approx([0.45, 0.7])
    assert odc["completion_mean_length"] == pytest.approx(50.0) and odc["completion_max_length"] == 200.0
    assert fsdp2["peak_rss_mb"] == [900.0, 912.0]  # per rank, the maximum over repeats
    ratios = result["ratios"]["odc"]
    # step time, per repeat: 9 / 12, 10 / 18, 13 / 14.4; the median 0.75 is not the ratio of medians (10 / 14.4)
    assert ratios["step_s"]["per_repeat"] == pytest.approx([0.75, 10 / 18, 13 / 14.4])
    assert ratios["step_s"]["median"] == pytest.approx(0.75)
    # slowest rank's generation: FSDP2 6 x scale, ODC 6 x scale
    assert ratios["generation_max_s"]["per_repeat"] == pytest.approx([5.4 / 6, 6 / 9, 7.8 / 7.2])
    assert ratios["generation_max_s"]["median"] == pytest.approx(0.9)
    # tokens/s: same tokens, so the inverse ratio of summed step times: 24 f / (20 g)
    assert ratios["tokens_per_s"]["median"] == pytest.approx(1.2 / 0.9)
    assert "fsdp2" not in result["ratios"]
    # the picture: the mean step of the median run (FSDP2: repeat 2; ODC: repeat 1), per rank
    t = result["timeline"]["fsdp2"]
    assert t["repeat"] == 2 and t["step_s"] == pytest.approx(14.4)
    assert t["generation_s"] == pytest.approx([7.2, 7.2]) and t["training_s"] == pytest.approx([4.8, 2.4])
    assert t["wait_s"] == pytest.approx([2.4, 4.8])
    assert result["timeline"]["odc"]["repeat"] == 1


def test_outputs_are_written_from_the_aggregated_figures(tmp_path):
    result = aggregate(_runs())
    result["config"] = dict(
        command="python -m benchmarks.grpo", world_size=2, per_device_train_batch_size=4,
        gradient_accumulation_steps=1, num_generations=4, completions_per_step=8, max_completion_length=256,
        max_steps=3, warmup=1, repeats=3,
    )  # fmt: skip
    result["conditions"] = dict(load_min=0.1, load_max=0.5, cpus=2, date="today", allocator="caching")
    files = write_outputs(result, tmp_path)
    table = files["table"].read_text()
    assert "ODC + plan free / FSDP2 (TRL), step time" in table
    assert "0.750x  (per repeat 0.556x to 0.903x)" in table
    assert "0.900x  (per repeat 0.667x to 1.083x)" in table
    snippet = files["snippet"].read_text()
    assert "| FSDP2 (TRL) | 14.40 | 59.0 | 7.20 7.20 | 4.80 2.40 | 2.40 4.80 | 25.0 | 50.0 / 200 | 1 |" in snippet
    assert "| ODC + plan free | 10.00 | 85.0 | 6.00 2.50 | 3.55 6.80 | 0.45 0.70 |" in snippet
    assert "- ODC + plan free / FSDP2 (TRL), step time: **0.750x**  (per repeat 0.556x to 0.903x)" in snippet
    assert json.loads(files["json"].read_text())["ratios"]["odc"]["step_s"]["median"] == pytest.approx(0.75)
    if importlib.util.find_spec("matplotlib") is not None:
        assert files["png"].stat().st_size > 1000


def test_arm_order_alternates_between_repeats():
    assert [arm_order(["fsdp2", "odc"], rep) for rep in range(3)] == [
        ["fsdp2", "odc"],
        ["odc", "fsdp2"],
        ["fsdp2", "odc"],
    ]


def test_cli_refuses_values_the_example_would_replace_or_cannot_run():
    with pytest.raises(SystemExit):
        parse_args(["--max_completion_length", "512"])  # replaced by the offline example
    with pytest.raises(SystemExit):
        parse_args(["--batch", "3"])  # 3 x 1 x 2 ranks completions: not whole groups of 4
    with pytest.raises(SystemExit):
        parse_args(["--", "--max_steps", "9"])  # the benchmark's own option
    with pytest.raises(SystemExit):
        parse_args(["--", "--odc_time_collectives=true"])  # would take FSDP2's waits out of busy, not generation
    with pytest.raises(SystemExit):
        parse_args(["--max_steps", "1", "--warmup", "1"])
    with pytest.raises(SystemExit):
        parse_args(["--arms", "fsdp2,nope"])
    opts = parse_args([])
    assert opts.out == ROOT / "benchmarks" / "grpo" and opts.arms == ["fsdp2", "odc"]


def test_both_arms_get_the_same_sizes_and_the_example_accepts_their_arguments(tmp_path, monkeypatch):
    opts = parse_args(["--batch", "2", "--grad_accum", "2", "--max_completion_length", "100", "--", "--beta", "0.0"])
    spec = importlib.util.spec_from_file_location("grpo_train", ROOT / "examples" / "grpo" / "train.py")
    train = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "grpo_train", train)  # its dataclasses resolve their annotations there
    spec.loader.exec_module(train)
    from odc_accelerate.scripts import rloo

    parsed = {}
    for name, arm in ARMS.items():
        cmd = command(arm, opts, tmp_path / name)["cmd"]
        example = "rloo" if name in RLOO_ARMS else "grpo"
        assert cmd[cmd.index("--config_file") + 1] == str(ROOT / "examples" / example / "configs" / arm.config)
        # the RLOO arms run the offline RLOO script's parser and main through benchmarks/grpo/rloo_train.py
        script = ROOT / ("benchmarks/grpo/rloo_train.py" if name in RLOO_ARMS else "examples/grpo/train.py")
        at = cmd.index(str(script))
        parser = rloo.make_parser() if name in RLOO_ARMS else train.make_parser()
        parsed[name] = parser.parse_args_and_config(cmd[at + 1 :], fail_with_unknown_args=True)[1]
    for training in parsed.values():
        assert (training.per_device_train_batch_size, training.gradient_accumulation_steps) == (2, 2)
        assert (training.num_generations, training.max_completion_length) == (4, 100)
        assert training.logging_steps == 1 and training.max_steps == opts.max_steps and training.beta == 0.0
        # generation is logged as wall time: busy must be wall time as well (FSDP2's waits not taken out of it)
        assert training.odc_time_collectives is False
    assert parsed["fsdp2"].odc is None and parsed["fsdp2"].odc_plan is None
    assert parsed["odc"].odc is True and parsed["odc"].odc_plan == "free"
    vllm = parsed["odc_vllm"]
    assert vllm.odc is True and vllm.odc_plan == "free" and vllm.use_vllm is True and vllm.vllm_mode == "colocate"
    assert not parsed["odc"].use_vllm and not parsed["fsdp2"].use_vllm
    plain = parsed["fsdp2_vllm"]
    assert plain.odc is None and plain.use_vllm is True and plain.vllm_mode == "colocate"
    # RLOO: TRL's trainer on plain FSDP2 against ODC's free plan, neither with vLLM
    assert type(parsed["rloo_odc"]).__name__ == type(parsed["rloo_fsdp2"]).__name__ == "ODCRLOOConfig"
    assert parsed["rloo_fsdp2"].odc is None and parsed["rloo_fsdp2"].odc_plan is None
    assert parsed["rloo_odc"].odc is True and parsed["rloo_odc"].odc_plan == "free"
    assert not parsed["rloo_odc"].use_vllm and not parsed["rloo_fsdp2"].use_vllm


def test_the_vllm_arm_runs_only_when_asked_for_and_where_vllm_is_installed(monkeypatch):
    import benchmarks.grpo.cli as cli

    assert not {"odc_vllm", "fsdp2_vllm"} & set(parse_args([]).arms)
    have = {"vllm": None}
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: have.get(name, object()))
    with pytest.raises(SystemExit):
        parse_args(["--arms", "odc,odc_vllm"])  # no vLLM here: refused before anything runs
    have["vllm"] = object()
    assert parse_args(["--arms", "odc,odc_vllm"]).arms == ["odc", "odc_vllm"]


def test_rloo_arms_are_compared_with_rloo_on_fsdp2_not_with_grpo():
    runs = _runs()
    # RLOO's runs: its FSDP2 arm 2x GRPO's FSDP2 step in every repeat, its ODC arm 1.5x GRPO's ODC
    runs["rloo_fsdp2"] = [
        make_record("rloo_fsdp2", parse_log_history(_fsdp2_history(2 * f)), [1000.0, 1000.0], 1, rep)
        for rep, f in enumerate(FSDP2_SCALES)
    ]
    runs["rloo_odc"] = [
        make_record("rloo_odc", parse_log_history(_odc_history(1.5 * g)), [1000.0, 1000.0], 1, rep)
        for rep, g in enumerate(ODC_SCALES)
    ]
    assert {baseline_of(n) for n in ARMS} == {"fsdp2", "rloo_fsdp2"}
    result = aggregate(runs)
    assert set(result["ratios"]) == {"odc", "rloo_odc"}  # no ratio of a baseline, none across trainers
    grpo, rloo = result["ratios"]["odc"]["step_s"], result["ratios"]["rloo_odc"]["step_s"]
    # per repeat: 1.5 x ODC's / (2 x FSDP2's) = 0.75 x GRPO's ratio of the same repeat
    assert rloo["per_repeat"] == pytest.approx([0.75 * r for r in grpo["per_repeat"]])
    assert result["arms"]["rloo_fsdp2"]["step_s"] == pytest.approx(2 * 14.4)
    # without its FSDP2 arm, an RLOO arm has no ratio (it is never divided by GRPO's)
    del runs["rloo_fsdp2"]
    assert set(aggregate(runs)["ratios"]) == {"odc"}


def test_rloo_arms_have_their_own_ratio_lines_and_say_which_examples_ran(tmp_path):
    runs = {
        "rloo_fsdp2": [make_record("rloo_fsdp2", parse_log_history(_fsdp2_history()), [900.0, 900.0], 1, 0)],
        "rloo_odc": [make_record("rloo_odc", parse_log_history(_odc_history()), [900.0, 900.0], 1, 0)],
    }
    result = aggregate(runs)
    result["config"] = dict(
        command="python -m benchmarks.grpo --arms rloo_fsdp2,rloo_odc", world_size=2, per_device_train_batch_size=4,
        gradient_accumulation_steps=1, num_generations=4, completions_per_step=8, max_completion_length=256,
        max_steps=3, warmup=1, repeats=1,
    )  # fmt: skip
    result["conditions"] = dict(load_min=0.1, load_max=0.5, cpus=2, date="today", allocator="caching")
    snippet = write_outputs(result, tmp_path)["snippet"].read_text()
    assert "- RLOO: ODC + plan free / RLOO: FSDP2 (TRL), step time: **0.833x**" in snippet  # 10 / 12
    assert "RLOO example on the GRPO example's rollout (offline" in snippet and "GRPO example and" not in snippet


@requires_trl_116
def test_the_rloo_arms_stop_completions_at_the_grpo_arms_target_lengths(tmp_path):
    """One RLOO step of the RLOO arms' trainer (ODC off, one process) on prompts whose continuations are 5 tokens: every
    completion has 5 tokens, the last one EOS, where TRL's own generation would run a random model's to the cap."""
    from transformers import AutoModelForCausalLM

    from benchmarks.grpo.rloo_train import TargetLengthRLOOTrainer
    from odc_accelerate.demo import ascii_text_reward, load_offline_tokenizer, offline_grpo_dataset, tiny_qwen2_config
    from odc_accelerate.integrations.trl import ODCRLOOConfig

    tokenizer = load_offline_tokenizer()
    dataset = offline_grpo_dataset(tokenizer=tokenizer)
    five = dataset.filter(lambda row: row["target_length"] == 5).select(range(4))
    config = tiny_qwen2_config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model = AutoModelForCausalLM.from_config(config, dtype="float32", attn_implementation="sdpa")
    args = ODCRLOOConfig(
        output_dir=str(tmp_path), bf16=False, use_cpu=True, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=16, max_steps=1, logging_steps=1, beta=0.0, report_to="none", save_strategy="no",
    )  # fmt: skip
    trainer = TargetLengthRLOOTrainer(
        model=model, reward_funcs=ascii_text_reward, args=args, train_dataset=five, processing_class=tokenizer
    )
    trainer.train()
    logged = next(row for row in trainer.state.log_history if "completions/mean_length" in row)
    assert logged["completions/mean_length"] == logged["completions/max_length"] == 5.0
    assert logged["completions/clipped_ratio"] == 0.0  # each ends with EOS, as the GRPO arms' completions do
    with pytest.raises(ValueError, match="target_length"):
        TargetLengthRLOOTrainer(
            model=model,
            reward_funcs=ascii_text_reward,
            args=args,
            train_dataset=five.remove_columns("target_length"),
            processing_class=tokenizer,
        )
