"""The SFT example (examples/sft/train.py) under real `accelerate launch`, 2 CPU processes, offline assets.

One module-scoped set of runs serves several assertions:

* ``odc``: ``--odc true`` (opt-in path 1), 5 samples per step so ranks run unequal microbatch counts; counts
  torch.distributed calls during microbatches; saves a checkpoint each step; ``--odc_memory_policy grads``: gradients
  stay unsharded until the step boundary (one scatter-add per param group and step, as the Trainer accumulates).
* ``single``: TRL's own ``SFTTrainer`` in one process, accumulating the same 5 samples per optimizer step
  (`tests/helpers/loops/trl_reference.py`, the session's ``sft_reference``): the reference for exact loss normalisation.
* ``plain_lockstep`` / ``odc_lockstep``: plain FSDP2 vs ODC (switched on by ``odc*`` keys in the accelerate config
  file, launched with ``odc-accelerate launch``: opt-in path 2) on the same equal-count microbatches.
* ``resumed``: ODC switched on by ``--fsdp_config odc.json`` (opt-in path 2), resumed from ``odc``'s first checkpoint,
  with accelerate's ``sync_each_batch`` and the default memory policy (``neither``: a scatter-add per microbatch).
* ``odc_padding_free``: ``odc`` with ``--padding_free true`` and a larger token budget, so that several truncated
  samples share one packed microbatch row (TRL alone refuses padding_free with max_length); its steps are traced.
* ``odc_auto``: ``odc`` with ``--odc_memory_policy auto`` and ranks whose memory differs by construction
  (``ODC_TEST_FREE_MEMORY``, read by `run_example.py`): rank 0 keeps everything, rank 1 only the decoder layers.
* ``odc_tied`` / ``odc_moe``: ``odc``'s unequal counts (default memory policy) on a Llama 3.2-shaped model with tied
  embeddings and on a Qwen3-MoE (the session's `tiny_model`, ``--model_name_or_path``), each against TRL's trainer
  in one process on that model (``single_tied`` / ``single_moe``), saving a checkpoint each step;
  ``resumed_tied`` / ``resumed_moe`` resume from their first checkpoint as ``resumed`` does. The MoE runs train
  with the router's auxiliary loss (``MOE_AUX_COEF``), its reference weighting it as ODC defines it.
* ``plain_lockstep_moe`` / ``odc_lockstep_moe``: plain FSDP2 vs ODC on the MoE with its auxiliary loss, one step of
  the same lockstep microbatches.
* ``odc_hybrid``: ``odc``'s unequal counts, one step of short samples, on a Qwen3.5-MoE hybrid (3 Gated DeltaNet
  layers, 1 full attention; TRL's default padded rows, which ODC plans padded), against TRL's trainer in one process
  (``single_hybrid``); the FSDP2 wrapping finds its decoder layers though transformers lists a vision block.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from integration_utils import (
    CONFIGS,
    HYBRID,
    MODEL_KINDS,
    MOE_AUX_COEF,
    RUN_EXAMPLE,
    SFT_PARITY,
    SFT_SAMPLES_PER_STEP,
    TRAIN,
    accelerate_launch,
    assert_saved_model_is_the_trained_one,
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

COMMON = SFT_PARITY
UNEQUAL = ["--odc_samples_per_step", str(SFT_SAMPLES_PER_STEP)]  # as the TRL reference (sft_reference)
DUMP = {"ODC_DUMP_PARAMS": "1"}
# Free (and total) memory per rank for memory_policy=auto; the default headroom (30%) leaves a budget of 70%. Rank 0:
# room for everything. Rank 1: ~1.4 MiB, room for both decoder layers' params and grads (2 x 2 x 0.24 MiB unsharded,
# fp32) but not for the embedding or the lm_head (2.1 MiB each with the suite's 8,192 BPE ranks, 37 MiB with all).
AUTO_FREE_MEMORY = "1TiB,2MiB"
# The hybrid model's one step: short samples (the later values win), a budget of about two of them per microbatch.
HYBRID_SHORT = ["--max_steps", "1", "--max_length", "40", "--odc_max_tokens_per_microbatch", "80"]


def _aux(kind: str) -> float:
    """The router's auxiliary-loss coefficient a kind's unequal-count runs train with: on for the MoE."""
    return MOE_AUX_COEF if kind == "moe" else 0.0


# The run names of each model kind: the offline default's ("odc", "single", "resumed"), else "<name>_<kind>".
def _name(name: str, kind: str) -> str:
    return name if kind == "untied" else f"{name}_{kind}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sft_reference, references, tiny_model):
    root = tmp_path_factory.mktemp("sft")
    shm_before = shm_leftovers()
    names = ("odc", "single", "plain_lockstep", "odc_lockstep", "resumed", "odc_padding_free", "odc_auto")
    names += ("odc_ordered", "odc_ordered_slowed", "plain_lockstep_moe", "odc_lockstep_moe")
    names += tuple(_name(n, kind) for kind in MODEL_KINDS[1:] for n in ("odc", "single", "resumed"))
    names += ("odc_hybrid", "single_hybrid")
    out = {name: root / name for name in names}
    procs = {}
    hybrid = [*COMMON, *model_args(tiny_model, HYBRID), *HYBRID_SHORT]
    procs["odc_hybrid"] = background(
        accelerate_launch, CONFIGS / "odc_cpu.yaml", TRAIN, "--odc", "true", *hybrid, *UNEQUAL,
        "--save_strategy", "no", "--output_dir", out["odc_hybrid"], **DUMP,
    )  # fmt: skip
    procs["single_hybrid"], out["single_hybrid"] = references.start(
        "sft", SFT_SAMPLES_PER_STEP, *hybrid, "--save_strategy", "no"
    )
    for kind in MODEL_KINDS[1:]:  # first: these and their references take longest
        model = model_args(tiny_model, kind, aux=_aux(kind))
        trace = {"ODC_TRACE_DIR": str(out[_name("odc", kind)] / "trace")} if kind == "moe" else {}
        procs[_name("odc", kind)] = background(
            accelerate_launch,
            CONFIGS / "odc_cpu.yaml",
            TRAIN,
            "--odc",
            "true",
            *COMMON,
            *UNEQUAL,
            *model,
            "--save_strategy",
            "steps",
            "--save_steps",
            "1",
            "--output_dir",
            out[_name("odc", kind)],
            **trace,
            **DUMP,
        )
        single = _name("single", kind)
        # The MoE's router term weighted by each microbatch's share of the step's tokens, as ODC weights it
        share = ["--aux_token_share"] if kind == "moe" else []
        procs[single], out[single] = references.start(
            "sft", SFT_SAMPLES_PER_STEP, *COMMON, *model, *share, "--save_strategy", "no"
        )
    procs["odc"] = background(
        accelerate_launch,
        CONFIGS / "odc_cpu.yaml",
        TRAIN,
        "--odc",
        "true",
        "--odc_memory_policy",
        "grads",
        *COMMON,
        *UNEQUAL,
        "--save_strategy",
        "steps",
        "--save_steps",
        "1",
        "--output_dir",
        out["odc"],
        ODC_COUNT_DIST_CALLS="1",
        ODC_TRACE_DIR=str(out["odc"] / "trace"),
        **DUMP,
    )
    procs["single"], out["single"] = sft_reference
    procs["odc_padding_free"] = background(
        accelerate_launch,
        CONFIGS / "odc_cpu.yaml",
        TRAIN,
        "--odc",
        "true",
        *COMMON,
        *UNEQUAL,
        "--padding_free",
        "true",
        "--odc_max_tokens_per_microbatch",  # the later value wins: room for several samples per packed row
        "384",
        "--save_strategy",
        "no",
        "--output_dir",
        out["odc_padding_free"],
        ODC_TRACE_DIR=str(out["odc_padding_free"] / "trace"),
        **DUMP,
    )
    for name, slow in (("odc_ordered", {}), ("odc_ordered_slowed", {"ODC_TEST_RANDOM_SLOW": "1:7"})):
        procs[name] = background(
            accelerate_launch,
            CONFIGS / "odc_cpu.yaml",
            TRAIN,
            "--odc",
            "true",
            "--odc_reduction",
            "ordered",
            *COMMON,
            *UNEQUAL,
            "--save_strategy",
            "no",
            "--output_dir",
            out[name],
            **slow,
            **DUMP,
        )
    procs["odc_auto"] = background(
        accelerate_launch,
        CONFIGS / "odc_cpu.yaml",
        TRAIN,
        "--odc",
        "true",
        "--odc_memory_policy",
        "auto",
        *COMMON,
        *UNEQUAL,
        "--save_strategy",
        "no",
        "--output_dir",
        out["odc_auto"],
        ODC_TEST_FREE_MEMORY=AUTO_FREE_MEMORY,
        ODC_TRACE_DIR=str(out["odc_auto"] / "trace"),
        **DUMP,
    )
    lockstep = [*COMMON, "--per_device_train_batch_size", "2", "--save_strategy", "no"]
    procs["plain_lockstep"] = background(
        accelerate_launch,
        CONFIGS / "fsdp2_cpu.yaml",
        TRAIN,
        "--odc_plan",
        "lockstep",
        *lockstep,
        "--output_dir",
        out["plain_lockstep"],
        ODC_TIME_COLLECTIVES="1",  # synchronous FSDP2 collectives, timed as the benchmark does (same numbers)
        **DUMP,
    )
    # ODC switched on by keys in the accelerate config file, through `odc-accelerate launch` (no --odc flag)
    odc_lockstep_cfg = root / "odc_lockstep.yaml"
    odc_lockstep_cfg.write_text((CONFIGS / "odc_cpu.yaml").read_text().replace("odc_plan: free", "odc_plan: lockstep"))
    procs["odc_lockstep"] = background(
        accelerate_launch,
        odc_lockstep_cfg,
        TRAIN,
        *lockstep,
        "--output_dir",
        out["odc_lockstep"],
        launcher="odc",
        **DUMP,
    )
    # The MoE with its router's auxiliary loss: plain FSDP2 vs ODC on the same lockstep microbatches, one step
    moe_lockstep = [*lockstep, *model_args(tiny_model, "moe", aux=MOE_AUX_COEF), "--max_steps", "1"]
    procs["plain_lockstep_moe"] = background(
        accelerate_launch,
        CONFIGS / "fsdp2_cpu.yaml",
        TRAIN,
        "--odc_plan",
        "lockstep",
        *moe_lockstep,
        "--output_dir",
        out["plain_lockstep_moe"],
        **DUMP,
    )
    procs["odc_lockstep_moe"] = background(
        accelerate_launch,
        odc_lockstep_cfg,
        TRAIN,
        *moe_lockstep,
        "--output_dir",
        out["odc_lockstep_moe"],
        launcher="odc",
        **DUMP,
    )
    fsdp_json = root / "odc_fsdp.json"
    fsdp_json.write_text(json.dumps({"odc": {"enable": True, "transport": "shm"}}))
    for kind in MODEL_KINDS:
        odc, resumed = _name("odc", kind), _name("resumed", kind)
        if procs[odc].result().returncode == 0:  # the resumed run starts from its checkpoint
            procs[resumed] = background(
                accelerate_launch,
                CONFIGS / "fsdp2_cpu.yaml",
                TRAIN,
                "--fsdp_config",
                fsdp_json,
                *COMMON,
                *UNEQUAL,
                *model_args(tiny_model, kind, aux=_aux(kind)),
                "--save_strategy",
                "no",
                "--resume_from_checkpoint",
                out[odc] / "checkpoint-1",
                "--accelerator_config",
                json.dumps({"gradient_accumulation_kwargs": {"sync_each_batch": True}}),
                "--output_dir",
                out[resumed],
                ODC_TRACE_DIR=str(out[resumed] / "trace"),
                **DUMP,
            )
    return {"out": out, "procs": results(procs), "shm_before": shm_before}


def _last_step_microbatches(out) -> list[int]:
    """Microbatches each rank ran in the last traced step."""
    return [
        len(json.loads((out / "trace" / f"trace_rank{r}.jsonl").read_text().splitlines()[-1])["microbatches"])
        for r in (0, 1)
    ]


def test_odc_run_finishes_with_metrics_and_zero_collectives(runs):
    check_ok(runs["procs"]["odc"])
    out = runs["out"]["odc"]
    history = logged_steps(out)
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        for key in ("loss", "odc/tokens_per_s", "odc/microbatches_min", "odc/microbatches_max", "odc/bubble_pct"):
            assert key in h, key
        # summaries over ranks by default (odc_metrics=summary); per-rank keys only with odc_metrics=per_rank
        assert 0 < h["odc/busy_s_min"] <= h["odc/busy_s_mean"] <= h["odc/busy_s_max"] < h["odc/step_s"] * 1.01
        assert 0 <= h["odc/wait_s_min"] <= h["odc/wait_s_mean"] <= h["odc/wait_s_max"]
        assert h["odc/busy_s_max"] + h["odc/wait_s_min"] == pytest.approx(h["odc/step_s"], abs=2e-4)
        assert not [key for key in h if key.startswith("odc/") and "_rank" in key]
    # 5 samples per step over 2 ranks: the ranks run different numbers of microbatches
    assert any(h["odc/microbatches_min"] != h["odc/microbatches_max"] for h in history)
    ranks = reports(out, "odc_run_rank")
    assert len(ranks) == 2
    for r in ranks:  # recorded inside each process
        assert r["engine"] == "ODCEngine" and r["fsdp_plugin"] == "ODCPlugin" and r["fsdp_version"] == 2
        assert r["distributed_type"] == "DistributedType.FSDP"
        assert r["odc_config"]["source"] == "args"
        assert r["gradient_accumulation_steps"] == 1
        calls = r["microbatch_dist_calls"]
        assert len(calls) >= 2 and all(c == {} for c in calls), calls
    assert sum(len(r["microbatch_dist_calls"]) for r in ranks) == sum(
        h["odc/microbatches_min"] + h["odc/microbatches_max"] for h in history
    )
    # odc_memory_policy=grads, as the Trainer accumulates: one scatter-add per param group per step
    assert max(_last_step_microbatches(out)) > 1
    for r in ranks:
        assert r["engine_last_step"]["scatters"] == r["engine_param_groups"] > 1, r["engine_last_step"]
        assert (
            r["engine_last_step"]["kept_grads"] == r["engine_param_groups"]
            and r["odc_config"]["memory_policy"] == "grads"
        )
    # each rank's peak memory, logged beside the times
    assert all(0 < h["odc/peak_mem_mb_min"] <= h["odc/peak_mem_mb_max"] for h in history)
    assert shm_leftovers() <= runs["shm_before"], "shared memory left behind"


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_odc_run_saves_a_model_that_loads_with_transformers(runs, kind):
    # FULL_STATE_DICT in the accelerate config: save_model gathers the full weights and writes them with the config
    # and the tokenizer, so the output directory loads as is and gives the trained model's logits.
    check_ok(runs["procs"][_name("odc", kind)])
    out = runs["out"][_name("odc", kind)]
    sentence = "Fully sharded data parallel training with on-demand communication."
    assert_saved_model_is_the_trained_one(out, sentence, kind)
    # each checkpoint holds the full weights too (and the optimizer state a resume reads)
    assert (out / "checkpoint-1" / "model.safetensors").is_file()


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_unequal_counts_match_trls_own_trainer_in_one_process(runs, kind):
    check_ok(runs["procs"][_name("odc", kind)])
    check_ok(runs["procs"][_name("single", kind)])
    odc, single = runs["out"][_name("odc", kind)], runs["out"][_name("single", kind)]
    h_odc, h_single = logged_steps(odc), logged_steps(single)
    for a, b in zip(h_odc, h_single, strict=True):
        # the exact per-token mean over the global batch, and the tokens of every rank
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)  # fp32 summation order
        assert a["num_tokens"] == b["num_tokens"]
    # Same weights up to fp32 summation order (different microbatch shapes and reduction order): the difference is
    # a tiny fraction of the training update itself. A per-microbatch mean loss would be off by percents here.
    a, b, init = final_params(odc), final_params(single), torch.load(single / "initial_params.pt")
    assert torch.load(odc / "initial_params.pt").keys() == init.keys()
    assert max_rel(torch.load(odc / "initial_params.pt"), init) == 0.0  # the same model to start from
    diff = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    update = sum(float((b[k] - init[k]).norm() ** 2) for k in b) ** 0.5
    assert update > 0 and diff / update <= 1e-4, (diff, update)
    assert max_rel(a, b) <= 1e-4
    if kind == "moe":
        # The router term on (its weighting: each microbatch's share of the step's tokens); one sample per
        # microbatch on both sides (5 microbatches per step over the ranks), as in the reference
        assert all(h["aux_loss"] > 1.0 for h in h_odc)
        assert sum(_last_step_microbatches(odc)) == SFT_SAMPLES_PER_STEP
        for h, ref in zip(h_odc, h_single, strict=True):  # every sample fills max_length: shares equal TRL's 1/G
            assert h["aux_loss"] == pytest.approx(ref["aux_loss"], rel=1e-5)


def test_hybrid_linear_attention_model_matches_trls_own_trainer_in_one_process(runs):
    check_ok(runs["procs"]["odc_hybrid"])
    check_ok(runs["procs"]["single_hybrid"])
    odc, single = runs["out"]["odc_hybrid"], runs["out"]["single_hybrid"]
    (a_step,), (b_step,) = logged_steps(odc), logged_steps(single)
    assert a_step["loss"] == pytest.approx(b_step["loss"], rel=1e-5)
    assert a_step["grad_norm"] == pytest.approx(b_step["grad_norm"], rel=1e-4)
    assert a_step["num_tokens"] == b_step["num_tokens"]
    assert a_step["odc/microbatches_min"] != a_step["odc/microbatches_max"], "ranks ran equal microbatches"
    a, b, init = final_params(odc), final_params(single), torch.load(single / "initial_params.pt")
    assert max_rel(torch.load(odc / "initial_params.pt"), init) == 0.0
    assert any(".linear_attn." in k for k in a)  # the Gated DeltaNet layers trained too
    diff = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    update = sum(float((b[k] - init[k]).norm() ** 2) for k in b) ** 0.5
    assert update > 0 and diff / update <= 1e-4, (diff, update)
    print(f"hybrid SFT: |diff| / |update| = {diff / update:.2e}, max rel {max_rel(a, b):.2e}")


def test_ordered_reduction_repeats_bit_for_bit_with_a_slowed_rank_and_matches_one_process(runs):
    # --odc_reduction ordered: each rank sums its microbatches locally and each owner sums the ranks in rank order, so
    # a rank slowed at random microbatches (the ranks reach each step's boundary in another order) changes no bit.
    for name in ("odc_ordered", "odc_ordered_slowed", "single"):
        check_ok(runs["procs"][name])
    out = runs["out"]
    ranks = reports(out["odc_ordered"], "odc_run_rank")
    assert [(r["odc_config"]["reduction"], r["reduction"]) for r in ranks] == [("ordered", "ordered")] * 2
    a, b = final_params(out["odc_ordered"]), final_params(out["odc_ordered_slowed"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), max_rel(a, b)
    single, init = final_params(out["single"]), torch.load(out["single"] / "initial_params.pt")
    diff = sum(float((a[k] - single[k]).norm() ** 2) for k in a) ** 0.5
    update = sum(float((single[k] - init[k]).norm() ** 2) for k in single) ** 0.5
    assert update > 0 and diff / update <= 1e-4, (diff, update)
    assert max_rel(a, single) <= 1e-4


def test_auto_policy_choosing_differently_per_rank_matches_single_process(runs):
    # memory_policy=auto on ranks with different free memory: each rank keeps what fits its own budget, in the same
    # steps, and the run still trains as TRL's trainer in one process on the same 5 samples per step.
    check_ok(runs["procs"]["odc_auto"])
    check_ok(runs["procs"]["single"])
    out, single = runs["out"]["odc_auto"], runs["out"]["single"]
    ranks = reports(out, "odc_run_rank")
    assert [r["odc_config"]["memory_policy"] for r in ranks] == ["auto", "auto"]
    choices = [r["memory_choices"] for r in ranks]
    assert choices[0].keys() == choices[1].keys() and len(choices[0]) > 2
    layers = {fqn for fqn in choices[0] if ".layers." in f".{fqn}."}
    assert len(layers) == 2, choices
    assert set(choices[0].values()) == {"both"}, choices
    assert {fqn: c for fqn, c in choices[1].items() if c != "neither"} == dict.fromkeys(layers, "both"), choices
    # the choices took effect in the last step: a rank reduces a kept gradient once, the others after each microbatch
    microbatches = _last_step_microbatches(out)
    assert microbatches[1] > 1, microbatches
    for r, kept in zip(ranks, (len(choices[0]), len(layers)), strict=True):
        last = r["engine_last_step"]
        groups = r["engine_param_groups"]
        assert (last["kept_params"], last["kept_grads"]) == (kept, kept), last
        assert last["scatters"] == kept + (groups - kept) * microbatches[r["rank"]], (last, microbatches)
    for a, b in zip(logged_steps(out), logged_steps(single), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)  # fp32 summation order
        assert a["num_tokens"] == b["num_tokens"]
    a, b, init = final_params(out), final_params(single), torch.load(single / "initial_params.pt")
    diff = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    update = sum(float((b[k] - init[k]).norm() ** 2) for k in b) ** 0.5
    assert update > 0 and diff / update <= 1e-4, (diff, update)
    assert max_rel(a, b) <= 1e-4


def test_odc_matches_plain_fsdp2_on_equal_counts(runs):
    check_ok(runs["procs"]["plain_lockstep"])
    check_ok(runs["procs"]["odc_lockstep"])
    plain, odc = runs["out"]["plain_lockstep"], runs["out"]["odc_lockstep"]
    assert [r["engine"] for r in reports(plain, "odc_run_rank")] == [None, None]
    odc_reports = reports(odc, "odc_run_rank")
    assert [r["engine"] for r in odc_reports] == ["ODCEngine", "ODCEngine"]
    # switched on by the accelerate config's odc keys, exported by `odc-accelerate launch`
    assert all(r["odc_config"]["source"] == "env" and r["odc_config"]["plan"] == "lockstep" for r in odc_reports)
    h_plain, h_odc = logged_steps(plain), logged_steps(odc)
    for a, b in zip(h_odc, h_plain, strict=True):
        assert a["odc/microbatches_min"] == a["odc/microbatches_max"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        # plain FSDP2 on the lockstep plan blocks in its (timed) collectives; ODC does not run FSDP2's
        assert b["odc/wait_s_min"] > 0
    # the collective timer is closed when training ends (saving and the final report ran untimed)
    assert [r["timed_dist_functions"] for r in reports(plain, "odc_run_rank")] == [[], []]
    assert max_rel(final_params(odc), final_params(plain)) <= 1e-6


def test_moe_router_aux_loss_odc_matches_plain_fsdp2_on_lockstep(runs):
    """A MoE's router auxiliary loss under the lockstep plan: ODC's update equals plain FSDP2's on the same
    microbatches, and both log the step's weighted ``aux_loss``."""
    check_ok(runs["procs"]["plain_lockstep_moe"])
    check_ok(runs["procs"]["odc_lockstep_moe"])
    plain, odc = runs["out"]["plain_lockstep_moe"], runs["out"]["odc_lockstep_moe"]
    init = torch.load(plain / "initial_params.pt")
    a, b = final_params(odc), final_params(plain)
    diff = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    update = sum(float((b[k] - init[k]).norm() ** 2) for k in b) ** 0.5
    assert update > 0 and diff / update <= 1e-4, (diff, update)
    (h_odc,), (h_plain,) = logged_steps(odc), logged_steps(plain)
    assert h_odc["aux_loss"] == pytest.approx(h_plain["aux_loss"], rel=1e-5)
    assert h_odc["aux_loss"] > 1.0  # E x sum_e f_e P_e: 2 (top-2) for a balanced router
    assert h_odc["loss"] == pytest.approx(h_plain["loss"], rel=1e-5)


def test_padding_free_packs_truncated_samples_and_matches_single_process(runs):
    check_ok(runs["procs"]["odc_padding_free"])
    check_ok(runs["procs"]["single"])
    out, single = runs["out"]["odc_padding_free"], runs["out"]["single"]
    for a, b in zip(logged_steps(out), logged_steps(single), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["num_tokens"] == b["num_tokens"]
    assert max_rel(final_params(out), final_params(single)) <= 1e-4
    steps = [
        json.loads(line) for r in (0, 1) for line in (out / "trace" / f"trace_rank{r}.jsonl").read_text().splitlines()
    ]
    microbatches = [mb for step in steps for mb in step["microbatches"]]
    # one packed row per microbatch, no attention mask, each sample truncated to --max_length, the row within budget
    assert all(mb["rows"] == 1 and "segments" in mb for mb in microbatches)
    assert all(max(mb["segments"]) <= 128 and mb["width"] <= 384 for mb in microbatches)
    assert any(len(mb["segments"]) > 1 for mb in microbatches), microbatches


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_resume_from_checkpoint_matches_uninterrupted_run(runs, kind):
    check_ok(runs["procs"][_name("odc", kind)])
    check_ok(runs["procs"][_name("resumed", kind)])
    resumed, uninterrupted = runs["out"][_name("resumed", kind)], runs["out"][_name("odc", kind)]
    for r in reports(resumed, "odc_run_rank"):
        assert r["engine"] == "ODCEngine" and r["odc_config"]["source"] == "fsdp_config"
        assert r["odc_config"]["transport"] == "shm"
    # memory policy neither (the default; sync_each_batch agrees): a scatter-add per param group per microbatch, and
    # the result of the run that kept its gradients
    microbatches = _last_step_microbatches(resumed)
    assert max(microbatches) > 1
    for r in reports(resumed, "odc_run_rank"):
        assert r["engine_last_step"]["scatters"] == r["engine_param_groups"] * microbatches[r["rank"]]
        assert r["engine_last_step"]["kept_grads"] == 0 and r["odc_config"]["memory_policy"] == "neither"
    assert [h["step"] for h in logged_steps(resumed)][-1] == 2
    assert logged_steps(resumed)[-1]["loss"] == pytest.approx(logged_steps(uninterrupted)[-1]["loss"], rel=1e-6)
    assert max_rel(final_params(resumed), final_params(uninterrupted)) <= 1e-6


BAD_CONFIGS = {  # id: (arguments, environment, what the error says)
    "no-fsdp": (["--odc", "true"], {}, "ODC needs FSDP2, but this run does not use FSDP"),
    "unknown-transport": (
        ["--odc", "true", "--odc_transport", "bogus"],
        {},
        "Unknown odc_transport (ODC_TRANSPORT) 'bogus'; choose one of auto",
    ),
    "fsdp1": (
        ["--odc", "true"],
        {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"},
        "ODC needs FSDP2, but the FSDP config asks for FSDP1",
    ),
    "budget-too-small": (
        ["--odc_plan", "free", "--max_length", "None", "--odc_max_tokens_per_microbatch", "32"],
        {},
        "is smaller than the longest sample",
    ),
    # Packed rows would let a sample's recurrent state into the next; on CPU the kernels that keep them apart are absent
    "hybrid-padding-free": (
        ["--odc", "true", "--model_name_or_path", "{hybrid}", "--router_aux_loss_coef", "0", "--padding_free", "true"],
        {},
        "--padding_free true packs several samples into one row, but Qwen3_5MoeTextConfig has linear_attention layers",
    ),
}


@pytest.fixture(scope="module")
def bad_config_runs(tmp_path_factory, tiny_model):
    """Every `BAD_CONFIGS` run, started together (`background`): id -> (its future, its output folder)."""
    root = tmp_path_factory.mktemp("bad_config")
    started = {}
    for name, (args, env, _) in BAD_CONFIGS.items():
        folders = {"{moe}": "moe", "{hybrid}": HYBRID}  # the session's model folders
        args = [str(tiny_model(folders[arg])) if arg in folders else arg for arg in args]
        cmd = [sys.executable, RUN_EXAMPLE, TRAIN, *args, "--max_steps", "1", "--report_to", "none"]
        started[name] = (background(run, [*cmd, "--output_dir", root / name], env=base_env(**env)), root / name)
    return started


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_config_fails_before_training(bad_config_runs, name):
    future, out = bad_config_runs[name]
    proc = future.result()
    assert proc.returncode != 0
    assert BAD_CONFIGS[name][2] in proc.stderr, proc.stderr[-3000:]
    if name == "hybrid-padding-free":
        assert "pip install flash-linear-attention causal-conv1d" in proc.stderr, proc.stderr[-3000:]
        assert "pass --padding_free false" in proc.stderr, proc.stderr[-3000:]
    assert not (out / "trainer_state.json").exists()


def test_samples_over_budget_warn_once_and_train(tmp_path):
    # Truncation on, budget below max_length: training goes on (each longer sample alone in its microbatch), with one
    # warning naming how many samples exceed the budget, the longest, and the two settings that fix it.
    from odc_accelerate.demo import load_offline_tokenizer, offline_sft_dataset

    proc = run(
        [
            sys.executable,
            RUN_EXAMPLE,
            TRAIN,
            "--odc_plan",
            "free",
            "--max_length",
            "512",
            "--odc_max_tokens_per_microbatch",
            "32",
            "--max_steps",
            "1",
            "--logging_steps",
            "1",
            "--report_to",
            "none",
            "--save_strategy",
            "no",
            "--dataloader_pin_memory",
            "false",
            "--output_dir",
            tmp_path,
        ]
    )
    check_ok(proc)
    assert [h["step"] for h in logged_steps(tmp_path)] == [1]
    found = re.findall(
        r"ODC: (\d+) of (\d+) training samples are longer than the token budget per microbatch \(32 tokens\); the "
        r"longest has (\d+) tokens",
        proc.stderr,
    )
    assert len(found) == 1, proc.stderr[-3000:]
    assert "Raise --odc_max_tokens_per_microbatch to at least 512, or lower --max_length to 32." in proc.stderr
    # Expected figures from the offline text itself, processed as TRL's SFT does: EOS appended, tokenized, truncated.
    tokenizer = load_offline_tokenizer()
    texts = offline_sft_dataset()["text"]
    lengths = [min(512, len(tokenizer(text + tokenizer.eos_token)["input_ids"])) for text in texts]
    over, total, longest = (int(x) for x in found[0])
    assert (over, total, longest) == (sum(n > 32 for n in lengths), len(lengths), max(lengths))
    assert 0 < over < total and longest == 512


def test_trl_recipe_yaml_and_cli_switch_odc_on(tmp_path):
    """Opt-in through a TRL ``--config recipe.yaml`` and through command-line flags, as train.py parses them."""
    sys.path.insert(0, str(TRAIN.parent))
    try:
        from train import make_parser
    finally:
        sys.path.pop(0)
    from odc_accelerate.config import ODCConfig

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("odc: true\nodc_plan: lockstep\nodc_transport: shm\nodc_max_tokens_per_microbatch: 4096\n")
    _, args, _, _ = make_parser().parse_args_and_config(["--config", str(recipe), "--output_dir", str(tmp_path)])
    config = ODCConfig.from_sources(args=args)
    assert (config.enable, config.source, config.plan, config.transport, config.max_tokens_per_microbatch) == (
        True,
        "args",
        "lockstep",
        "shm",
        4096,
    )
    _, args, _, _ = make_parser().parse_args_and_config(
        ["--odc", "true", "--odc_timeout", "30", "--odc_time_collectives", "true", "--output_dir", str(tmp_path)]
    )
    config = ODCConfig.from_sources(args=args)
    assert (config.enable, config.source, config.timeout, config.plan, config.time_collectives) == (
        True,
        "args",
        30.0,
        "free",
        True,
    )
    _, args, _, _ = make_parser().parse_args_and_config(["--output_dir", str(tmp_path)])
    assert ODCConfig.from_sources(args=args).enable is False
    with pytest.warns(FutureWarning, match="--odc_balance is deprecated"):  # the old flag still parses and works
        _, args, _, _ = make_parser().parse_args_and_config(
            ["--odc", "true", "--odc_balance", "lockstep", "--output_dir", str(tmp_path)]
        )
        assert ODCConfig.from_sources(args=args).plan == "lockstep"


def test_bf16_odc_bit_identical_to_plain_fsdp2(tmp_path):
    # bf16 mixed precision (fp32 reduce), one sample per rank per step: ODC's whole-step sum equals FSDP2's
    # reduce-scatter exactly, so losses and weights must match bit for bit.
    args = [*COMMON, "--bf16", "true", "--per_device_train_batch_size", "1", "--odc_plan", "lockstep"]
    args += ["--save_strategy", "no"]
    plain = background(
        accelerate_launch, CONFIGS / "fsdp2_cpu.yaml", TRAIN, *args, "--output_dir", tmp_path / "plain", **DUMP
    )
    odc = background(
        accelerate_launch,
        CONFIGS / "odc_cpu.yaml",
        TRAIN,
        "--odc",
        "true",
        *args,
        "--output_dir",
        tmp_path / "odc",
        **DUMP,
    )
    plain, odc = plain.result(), odc.result()
    check_ok(plain)
    check_ok(odc)
    assert [r["engine"] for r in reports(tmp_path / "odc", "odc_run_rank")] == ["ODCEngine", "ODCEngine"]
    assert [r["engine"] for r in reports(tmp_path / "plain", "odc_run_rank")] == [None, None]
    assert [h["loss"] for h in logged_steps(tmp_path / "odc")] == [h["loss"] for h in logged_steps(tmp_path / "plain")]
    # TRL's metric gathers, answered locally and fixed at the step boundary (their order is TRL's private internal)
    for a, b in zip(logged_steps(tmp_path / "odc"), logged_steps(tmp_path / "plain"), strict=True):
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-5)
        assert a["mean_token_accuracy"] == pytest.approx(b["mean_token_accuracy"], abs=1e-6)
        assert a["num_tokens"] == b["num_tokens"]
    p_odc, p_plain = final_params(tmp_path / "odc"), final_params(tmp_path / "plain")
    assert p_odc.keys() == p_plain.keys()
    for name, expected in p_plain.items():
        assert p_odc[name].dtype == expected.dtype and torch.equal(p_odc[name], expected), name
