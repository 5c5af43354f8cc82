"""The DPO example (examples/dpo/train.py) under real `accelerate launch`, 2 CPU processes, offline assets.

Module-scoped runs (2 optimizer steps each, fp32 unless named):

* ``odc``: ``--odc true``, 5 pairs per step so the ranks run different numbers of microbatches; reference model
  served by the gather-only engine; torch.distributed calls counted during microbatches.
* ``single``: TRL's own ``DPOTrainer`` in one process, accumulating the same 5 pairs per optimizer step
  (`tests/helpers/loops/trl_reference.py`): the ground truth for the exact pair-mean loss.
* ``odc_pre``: as ``odc`` with ``--precompute_ref_log_probs true``.
* ``plain_bf16`` / ``odc_bf16``: plain FSDP2 vs ODC, bf16, one pair per rank per step (lockstep plan).
* ``plain_fp32`` / ``odc_fp32``: plain FSDP2 vs ODC, fp32, two pairs per rank per step; the plain run uses
  precomputed reference log-probs, the ODC run the on-the-fly reference model (both paths under both backends
  are covered between this pair and the ones above).
* ``odc_peft``: ``--odc true --use_peft`` (LoRA; the reference is the policy with its adapters disabled).
* ``odc_tied`` / ``odc_moe``: ``odc`` on a Llama 3.2-shaped model with tied embeddings and on a Qwen3-MoE (the
  session's `tiny_model`, ``--model_name_or_path``), each against TRL's trainer in one process on that model;
  ``odc_peft_tied`` / ``odc_peft_moe``: ``odc_peft`` on them, the MoE's LoRA on its attention, router and fused experts
  (``--lora_target_parameters mlp.experts.gate_up_proj mlp.experts.down_proj``). ``odc_moe`` trains with the router's
  auxiliary loss (``MOE_AUX_COEF``), its reference weighting it as ODC defines it.
* ``plain_lockstep_moe`` / ``odc_lockstep_moe``: plain FSDP2 vs ODC on the MoE with its auxiliary loss, one step of
  two pairs per rank (lockstep plan).
* ``odc_hybrid``: ``odc``, one step of short pairs, on a Qwen3.5-MoE hybrid (3 Gated DeltaNet layers, 1 full
  attention) with ``--padding_free true``, which without the linear-attention kernels trains DPO's padded rows, against
  TRL's trainer in one process (``single_hybrid``).
* ``odc_packed``: ``odc`` with ``--padding_free true`` at ``--max_length 96`` (pairs of unequal lengths), each
  microbatch's pairs packed into one row, against TRL's padded trainer in one process (``single_packed``).
"""

from __future__ import annotations

import json

import pytest
import torch
from integration_utils import (
    DPO_METRICS,
    HYBRID,
    MODEL_KINDS,
    MOE_AUX_COEF,
    ROOT,
    accelerate_launch,
    assert_dpo_metrics_match,
    assert_same_logits,
    assert_saved_model_is_the_trained_one,
    background,
    check_ok,
    final_params,
    logged_steps,
    max_rel,
    model_args,
    reports,
    results,
    shm_leftovers,
)

CONFIGS = ROOT / "examples" / "dpo" / "configs"
TRAIN = ROOT / "examples" / "dpo" / "train.py"

COMMON = [
    "--max_steps",
    "2",
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
    "--learning_rate",
    "0.2",
    "--seed",
    "0",
    "--dataloader_pin_memory",
    "false",
    "--save_strategy",
    "no",
]
UNEQUAL = ["--odc_samples_per_step", "5"]
HYBRID_SHORT = ["--max_steps", "1", "--max_length", "32", "--odc_max_tokens_per_microbatch", "96"]  # later values win
# Long enough that some sequences are shorter than max_length (TRL pads them), a budget of several pairs per row
PACKED = [*COMMON, "--max_length", "96", "--odc_max_tokens_per_microbatch", "384", *UNEQUAL]
PADDING_FREE = ["--padding_free", "true"]
DUMP = {"ODC_DUMP_PARAMS": "1"}
COUNT = {"ODC_COUNT_DIST_CALLS": "1"}
PEFT = ["--use_peft", "--lora_r", "8", "--learning_rate", "0.05"]  # the later --learning_rate wins
# PEFT has no default LoRA targets for Qwen3-MoE: every linear layer, and the experts' fused weights through PEFT's
# parameter LoRA (which needs lora_dropout 0)
MOE_LORA = ["--lora_target_modules", "all-linear", "--lora_dropout", "0", "--lora_target_parameters"]
MOE_LORA += ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


# The run names of each model kind: the offline default's ("odc", "single", "odc_peft"), else "<name>_<kind>".
def _name(name: str, kind: str) -> str:
    return name if kind == "untied" else f"{name}_{kind}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, references, tiny_model):
    root = tmp_path_factory.mktemp("dpo")
    shm_before = shm_leftovers()
    names = ("odc", "single", "odc_pre", "plain_bf16", "odc_bf16", "plain_fp32", "odc_fp32", "odc_peft")
    names += ("odc_ordered", "odc_ordered_slowed", "plain_lockstep_moe", "odc_lockstep_moe")
    names += tuple(_name(n, kind) for kind in MODEL_KINDS[1:] for n in ("odc", "single", "odc_peft"))
    names += ("odc_hybrid", "single_hybrid", "odc_packed", "single_packed")
    out = {name: root / name for name in names}
    procs = {}
    odc = [CONFIGS / "odc_cpu.yaml", TRAIN, "--odc", "true"]
    plain = [CONFIGS / "fsdp2_cpu.yaml", TRAIN]
    hybrid = [*COMMON, *model_args(tiny_model, HYBRID), *HYBRID_SHORT]
    procs["odc_hybrid"] = background(
        accelerate_launch, *odc, *hybrid, *UNEQUAL, *PADDING_FREE, "--output_dir", out["odc_hybrid"], **DUMP
    )
    procs["single_hybrid"], out["single_hybrid"] = references.start("dpo", 5, *hybrid)
    trace = {"ODC_TRACE_DIR": str(out["odc_packed"] / "trace")}
    procs["odc_packed"] = background(
        accelerate_launch, *odc, *PACKED, *PADDING_FREE, "--output_dir", out["odc_packed"], **trace, **DUMP
    )
    procs["single_packed"], out["single_packed"] = references.start("dpo", 5, *PACKED)
    for kind in MODEL_KINDS[1:]:  # first: these and their references take longest
        model = model_args(tiny_model, kind)
        name, single, peft = _name("odc", kind), _name("single", kind), _name("odc_peft", kind)
        if kind == "moe":  # with the router's auxiliary loss, the reference weighting it as ODC defines it
            aux = model_args(tiny_model, kind, aux=MOE_AUX_COEF)
            trace = {"ODC_TRACE_DIR": str(out[name] / "trace")}
            procs[name] = background(
                accelerate_launch, *odc, *COMMON, *UNEQUAL, *aux, "--output_dir", out[name], **trace, **DUMP
            )
            procs[single], out[single] = references.start("dpo", 5, *COMMON, *aux, "--aux_token_share")
        else:
            procs[name] = background(
                accelerate_launch, *odc, *COMMON, *UNEQUAL, *model, "--output_dir", out[name], **DUMP
            )
            procs[single], out[single] = references.start("dpo", 5, *COMMON, *model)
        lora = [*PEFT, *(MOE_LORA if kind == "moe" else [])]
        procs[peft] = background(
            accelerate_launch, *odc, *COMMON, *UNEQUAL, *model, *lora, "--output_dir", out[peft], **COUNT, **DUMP
        )
    procs["odc"] = background(
        accelerate_launch,
        *odc,
        *COMMON,
        *UNEQUAL,
        "--output_dir",
        out["odc"],
        ODC_TRACE_DIR=str(out["odc"] / "trace"),
        **COUNT,
        **DUMP,
    )
    procs["single"], out["single"] = references.start("dpo", 5, *COMMON)
    ordered = ["--odc_reduction", "ordered", *COMMON, *UNEQUAL]
    for name, slow in (("odc_ordered", {}), ("odc_ordered_slowed", {"ODC_TEST_RANDOM_SLOW": "0:3"})):
        procs[name] = background(accelerate_launch, *odc, *ordered, "--output_dir", out[name], **slow, **DUMP)
    pre = ["--precompute_ref_log_probs", "true", "--precompute_ref_batch_size", "16"]
    procs["odc_pre"] = background(
        accelerate_launch, *odc, *COMMON, *UNEQUAL, *pre, "--output_dir", out["odc_pre"], **COUNT, **DUMP
    )
    bf16 = [*COMMON, "--bf16", "true", "--per_device_train_batch_size", "1", "--odc_plan", "lockstep"]
    procs["plain_bf16"] = background(
        accelerate_launch, *plain, *bf16, "--output_dir", out["plain_bf16"], **COUNT, **DUMP
    )
    procs["odc_bf16"] = background(accelerate_launch, *odc, *bf16, "--output_dir", out["odc_bf16"], **COUNT, **DUMP)
    fp32 = [*COMMON, "--per_device_train_batch_size", "2", "--odc_plan", "lockstep"]
    procs["plain_fp32"] = background(accelerate_launch, *plain, *fp32, *pre, "--output_dir", out["plain_fp32"], **DUMP)
    procs["odc_fp32"] = background(accelerate_launch, *odc, *fp32, "--output_dir", out["odc_fp32"], **DUMP)
    # The MoE with its router's auxiliary loss: plain FSDP2 vs ODC on the same lockstep microbatches, one step
    moe_fp32 = [*fp32, *model_args(tiny_model, "moe", aux=MOE_AUX_COEF), "--max_steps", "1"]
    for name, launch in (("plain_lockstep_moe", plain), ("odc_lockstep_moe", odc)):
        procs[name] = background(accelerate_launch, *launch, *moe_fp32, "--output_dir", out[name], **DUMP)
    procs["odc_peft"] = background(
        accelerate_launch, *odc, *COMMON, *UNEQUAL, *PEFT, "--output_dir", out["odc_peft"], **COUNT, **DUMP
    )
    return {"out": out, "procs": results(procs), "shm_before": shm_before}


def _update(out) -> float:
    a, init = final_params(out), torch.load(out / "initial_params.pt")
    return sum(float((a[k] - init[k]).norm() ** 2) for k in a) ** 0.5


def test_odc_dpo_runs_with_zero_collectives_and_step_metrics(runs):
    check_ok(runs["procs"]["odc"])
    out = runs["out"]["odc"]
    history = logged_steps(out)
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        for key in ("loss", *DPO_METRICS, "odc/tokens_per_s", "odc/bubble_pct", "odc/busy_s_max"):
            assert key in h, key
    assert any(h["odc/microbatches_min"] != h["odc/microbatches_max"] for h in history)
    ranks = reports(out, "odc_run_rank")
    assert len(ranks) == 2
    for r in ranks:
        assert r["engine"] == "ODCEngine" and r["fsdp_plugin"] == "ODCPlugin"
        # the reference model is served by its own gather-only engine and was used in the forwards
        assert r["reference_engine"] == "ODCEngine" and r["reference_frozen"] is True
        assert r["reference_gathers"] > 0
        calls = r["microbatch_dist_calls"]
        assert len(calls) >= 2 and all(c == {} for c in calls), calls
    assert sum(len(r["microbatch_dist_calls"]) for r in ranks) == sum(
        h["odc/microbatches_min"] + h["odc/microbatches_max"] for h in history
    )
    # planned on padded shapes: each collated microbatch (chosen and rejected rows, padded to the longest) holds at
    # most the 128-token budget, unless it is one pair
    steps = [
        json.loads(line) for r in (0, 1) for line in (out / "trace" / f"trace_rank{r}.jsonl").read_text().splitlines()
    ]
    microbatches = [mb for step in steps for mb in step["microbatches"]]
    assert len(microbatches) == sum(h["odc/microbatches_min"] + h["odc/microbatches_max"] for h in history)
    assert all(mb["rows"] == 2 or mb["rows"] * mb["width"] <= 128 for mb in microbatches), microbatches
    assert shm_leftovers() <= runs["shm_before"], "shared memory left behind"


def test_plain_fsdp2_reference_forwards_are_collectives(runs):
    # Positive control for the counter: plain FSDP2 all-gathers the policy AND the reference per layer.
    check_ok(runs["procs"]["plain_bf16"])
    for r in reports(runs["out"]["plain_bf16"], "odc_run_rank"):
        assert r["engine"] is None and r["reference_engine"] is None
        assert all(sum(c.values()) > 0 for c in r["microbatch_dist_calls"])


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_unequal_counts_match_trls_own_trainer_in_one_process(runs, kind):
    check_ok(runs["procs"][_name("odc", kind)])
    check_ok(runs["procs"][_name("single", kind)])
    odc, single = runs["out"][_name("odc", kind)], runs["out"][_name("single", kind)]
    for a, b in zip(logged_steps(odc), logged_steps(single), strict=True):
        # the mean over every pair of the global batch, and DPO's per-pair metrics of the whole step (TRL, one pair
        # per accumulated microbatch, averages them over the step's pairs)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)  # fp32 summation order
        assert_dpo_metrics_match(a, b)
        assert a["num_tokens"] == b["num_tokens"]
    # rewards moved in step 2 (a check that cannot pass with all-zero metrics)
    assert logged_steps(single)[1]["rewards/margins"] != 0.0
    a, b = final_params(odc), final_params(single)
    diff = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    update = _update(single)
    assert update > 0 and diff / update <= 1e-4, (diff, update)
    if kind == "moe":
        # The router term on, weighted by each microbatch's share of the step's tokens on both sides; one pair per
        # microbatch (5 microbatches per step over the ranks), as in the reference
        assert all(h["aux_loss"] > 1.0 for h in logged_steps(odc))
        traced = [(odc / "trace" / f"trace_rank{r}.jsonl").read_text().splitlines() for r in (0, 1)]
        assert all(sum(len(json.loads(t[i])["microbatches"]) for t in traced) == 5 for i in range(len(traced[0])))


def test_moe_router_aux_loss_odc_matches_plain_fsdp2_on_lockstep(runs):
    """A MoE's router auxiliary loss under the lockstep plan: ODC's update equals plain FSDP2's on the same
    microbatches, and both log the step's weighted ``aux_loss``."""
    check_ok(runs["procs"]["plain_lockstep_moe"])
    check_ok(runs["procs"]["odc_lockstep_moe"])
    plain, odc = runs["out"]["plain_lockstep_moe"], runs["out"]["odc_lockstep_moe"]
    a, b = final_params(odc), final_params(plain)
    diff = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    update = _update(plain)
    assert update > 0 and diff / update <= 1e-4, (diff, update)
    (h_odc,), (h_plain,) = logged_steps(odc), logged_steps(plain)
    assert h_odc["aux_loss"] == pytest.approx(h_plain["aux_loss"], rel=1e-5)
    assert h_odc["aux_loss"] > 1.0  # E x sum_e f_e P_e: 2 (top-2) for a balanced router
    assert h_odc["loss"] == pytest.approx(h_plain["loss"], rel=1e-5)


def test_hybrid_linear_attention_model_matches_trls_own_trainer_in_one_process(runs):
    check_ok(runs["procs"]["odc_hybrid"])
    check_ok(runs["procs"]["single_hybrid"])
    odc, single = runs["out"]["odc_hybrid"], runs["out"]["single_hybrid"]
    (a_step,), (b_step,) = logged_steps(odc), logged_steps(single)
    assert a_step["loss"] == pytest.approx(b_step["loss"], rel=1e-5)
    assert a_step["grad_norm"] == pytest.approx(b_step["grad_norm"], rel=1e-4)
    assert_dpo_metrics_match(a_step, b_step)
    assert a_step["num_tokens"] == b_step["num_tokens"]
    # padding_free=True: without the linear-attention kernels the pairs stay padded, and the run says why
    assert [r["packs_pairs"] for r in reports(odc, "odc_run_rank")] == [False, False]
    assert "ODC trains these DPO pairs padded, one row per sequence, because its recurrent" in (
        runs["procs"]["odc_hybrid"].stderr
    )
    a, b = final_params(odc), final_params(single)
    assert any(".linear_attn." in k for k in a)  # the Gated DeltaNet layers trained too
    diff = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    update = _update(single)
    assert update > 0 and diff / update <= 1e-4, (diff, update)
    print(f"hybrid DPO: |diff| / |update| = {diff / update:.2e}, max rel {max_rel(a, b):.2e}")


def test_packed_pairs_match_trls_padded_dpo_in_one_process(runs):
    """``--padding_free true``: each planned microbatch is one packed row of its pairs' sequences, and training equals
    TRL's padded DPO on the same pairs (per-sequence log-prob sums, loss, gradients, weights)."""
    check_ok(runs["procs"]["odc_packed"])
    check_ok(runs["procs"]["single_packed"])
    odc, single = runs["out"]["odc_packed"], runs["out"]["single_packed"]
    assert "temporarily unavailable" not in runs["procs"]["odc_packed"].stderr  # TRL's "falling back to padding"
    every = []
    for r in reports(odc, "odc_run_rank"):
        assert r["packs_pairs"] is True
        traced = [
            json.loads(line) for line in (odc / "trace" / f"trace_rank{r['rank']}.jsonl").read_text().splitlines()
        ]
        microbatches = [mb for step in traced for mb in step["microbatches"]]
        # one row, chosen and rejected each a sequence of its own length; the policy's and the reference's forwards
        # of every microbatch ran packed
        assert all(mb["rows"] == 1 and len(mb["segments"]) % 2 == 0 for mb in microbatches), microbatches
        assert r["packed_forwards"] == 2 * len(microbatches)
        every += microbatches
    assert any(len(mb["segments"]) >= 4 for mb in every)  # several pairs in one row
    assert any(len(set(mb["segments"])) > 1 for mb in every)  # of unequal lengths: TRL pads them
    for a, b in zip(logged_steps(odc), logged_steps(single), strict=True):
        # the step's means of the per-sequence log-prob sums, chosen and rejected
        assert a["logps/chosen"] == pytest.approx(b["logps/chosen"], rel=1e-5)
        assert a["logps/rejected"] == pytest.approx(b["logps/rejected"], rel=1e-5)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert_dpo_metrics_match(a, b)
        assert a["num_tokens"] == b["num_tokens"]
    assert logged_steps(single)[1]["rewards/margins"] != 0.0
    a, b = final_params(odc), final_params(single)
    diff = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    update = _update(single)
    assert update > 0 and diff / update <= 1e-4, (diff, update)
    print(f"packed DPO: |diff| / |update| = {diff / update:.2e}, max rel {max_rel(a, b):.2e}")


def test_ordered_reduction_repeats_bit_for_bit_with_a_slowed_rank_and_matches_one_process(runs):
    # --odc_reduction ordered, one run with rank 0 slowed at random microbatches: the same bits, and TRL's trainer
    # in one process to fp32 summation order.
    for name in ("odc_ordered", "odc_ordered_slowed", "single"):
        check_ok(runs["procs"][name])
    out = runs["out"]
    ranks = reports(out["odc_ordered_slowed"], "odc_run_rank")
    assert [(r["odc_config"]["reduction"], r["reduction"]) for r in ranks] == [("ordered", "ordered")] * 2
    a, b = final_params(out["odc_ordered"]), final_params(out["odc_ordered_slowed"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    single = final_params(out["single"])
    diff = sum(float((a[k] - single[k]).norm() ** 2) for k in a) ** 0.5
    update = _update(out["single"])
    assert update > 0 and diff / update <= 1e-4, (diff, update)


def test_precomputed_reference_log_probs_match_on_the_fly_reference(runs):
    check_ok(runs["procs"]["odc_pre"])
    check_ok(runs["procs"]["odc"])
    pre, live = runs["out"]["odc_pre"], runs["out"]["odc"]
    for r in reports(pre, "odc_run_rank"):
        assert r["precompute_ref_log_probs"] is True
        assert all(c == {} for c in r["microbatch_dist_calls"])
    for a, b in zip(logged_steps(pre), logged_steps(live), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert_dpo_metrics_match(a, b, keys=("rewards/margins",))
    a, b = final_params(pre), final_params(live)
    diff = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    assert diff / _update(live) <= 1e-4


def test_bf16_odc_bit_identical_to_plain_fsdp2(runs):
    check_ok(runs["procs"]["plain_bf16"])
    check_ok(runs["procs"]["odc_bf16"])
    plain, odc = runs["out"]["plain_bf16"], runs["out"]["odc_bf16"]
    assert [r["reference_engine"] for r in reports(odc, "odc_run_rank")] == ["ODCEngine", "ODCEngine"]
    for r in reports(odc, "odc_run_rank"):
        assert all(c == {} for c in r["microbatch_dist_calls"])
    assert [h["loss"] for h in logged_steps(odc)] == [h["loss"] for h in logged_steps(plain)]
    p_odc, p_plain = final_params(odc), final_params(plain)
    assert p_odc.keys() == p_plain.keys()
    for name, expected in p_plain.items():
        assert torch.equal(p_odc[name], expected), name
    assert _update(plain) > 0


def test_fp32_odc_matches_plain_fsdp2(runs):
    check_ok(runs["procs"]["plain_fp32"])
    check_ok(runs["procs"]["odc_fp32"])
    plain, odc = runs["out"]["plain_fp32"], runs["out"]["odc_fp32"]
    for a, b in zip(logged_steps(odc), logged_steps(plain), strict=True):
        assert a["odc/microbatches_min"] == a["odc/microbatches_max"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert max_rel(final_params(odc), final_params(plain)) <= 1e-6
    assert _update(plain) > 0


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_peft_lora_policy_trains_adapters_only_without_collectives(runs, kind):
    check_ok(runs["procs"][_name("odc_peft", kind)])
    out = runs["out"][_name("odc_peft", kind)]
    for r in reports(out, "odc_run_rank"):
        assert r["engine"] == "ODCEngine"
        assert r["reference_engine"] is None  # no separate reference model: adapters disabled on the policy
        assert len(r["microbatch_dist_calls"]) >= 2 and all(c == {} for c in r["microbatch_dist_calls"])
    history = logged_steps(out)
    # step 1: policy == reference (adapters start at zero), step 2: the trained adapters moved the policy away from
    # the adapters-disabled reference
    assert history[0]["rewards/margins"] == 0.0 and history[0]["loss"] == pytest.approx(0.693147, abs=1e-5)
    assert history[1]["rewards/chosen"] != 0.0 and history[1]["rewards/rejected"] != 0.0
    final, init = final_params(out), torch.load(out / "initial_params.pt")
    assert final.keys() == init.keys()
    lora = [k for k in final if "lora_" in k]
    assert lora and any(not torch.equal(final[k], init[k]) for k in lora)
    if kind == "moe":  # the adapters of the fused experts trained too
        assert any(".experts." in k and not torch.equal(final[k], init[k]) for k in lora), lora
    for k in final:
        if "lora_" not in k:
            assert torch.equal(final[k], init[k]), f"frozen base weight {k} changed"


def _base(tiny_model, kind: str):
    """The policy a run of ``kind`` starts from: the offline default rebuilt as examples/dpo/train.py builds it (seed
    0), else the session's saved model."""
    from transformers import AutoModelForCausalLM, set_seed

    from odc_accelerate.demo import tiny_qwen2_config

    if kind != "untied":
        return AutoModelForCausalLM.from_pretrained(tiny_model(kind), dtype=torch.float32)
    set_seed(0)
    return AutoModelForCausalLM.from_config(tiny_qwen2_config(), dtype=torch.float32)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_odc_dpo_run_saves_a_model_that_loads_with_transformers(runs, kind):
    check_ok(runs["procs"][_name("odc", kind)])
    sentence = "Preference optimization with on-demand communication."
    assert_saved_model_is_the_trained_one(runs["out"][_name("odc", kind)], sentence, kind)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_peft_run_saves_an_adapter_that_loads_with_peft(runs, tiny_model, kind):
    # With PEFT, save_model writes the adapter only: it loads onto the base the run starts from.
    from peft import LoraConfig, PeftModel, get_peft_model

    check_ok(runs["procs"][_name("odc_peft", kind)])
    out = runs["out"][_name("odc_peft", kind)]
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()
    model = PeftModel.from_pretrained(_base(tiny_model, kind), out)
    trained, init = final_params(out), torch.load(out / "initial_params.pt")
    loaded = {name: p.detach() for name, p in model.named_parameters()}
    assert loaded.keys() == trained.keys()
    for name, expected in trained.items():
        if "lora_" not in name:  # the rebuilt base is the one the run started from
            assert torch.equal(loaded[name], init[name]), name
        assert torch.equal(loaded[name], expected), name
    reference = get_peft_model(_base(tiny_model, kind), LoraConfig.from_pretrained(out))
    # named_parameters lists a tied weight once (under the input embedding's name); the state dict has both names
    missing, unexpected = reference.load_state_dict(trained, strict=False)
    assert not unexpected and missing == (["base_model.model.lm_head.weight"] if kind == "tied" else []), missing
    assert_same_logits(model, reference, out, "Preference optimization with on-demand communication.")


BAD_CONFIGS = {  # id: (arguments, what the error says)
    "sync-ref-model": (["--sync_ref_model", "true"], "sync_ref_model=True is not supported with ODC"),
    # a loss that sorts within the microbatch, beside one ODC serves (the unit tests cover 'sft' and 'aot_unpaired')
    "aot-loss": (["--loss_type", "sigmoid", "aot"], "loss_type 'aot' sorts the policy's and the reference's"),
    "budget-too-small": (
        ["--max_length", "64", "--odc_max_tokens_per_microbatch", "40"],
        "smaller than the longest pair",
    ),
}


@pytest.fixture(scope="module")
def bad_config_runs(tmp_path_factory):
    """Every `BAD_CONFIGS` run, started together (`background`): id -> (its future, its output folder)."""
    root = tmp_path_factory.mktemp("bad_dpo_config")
    started = {}
    for name, (args, _) in BAD_CONFIGS.items():
        odc = [CONFIGS / "odc_cpu.yaml", TRAIN, "--odc", "true", *args, "--max_steps", "1", "--report_to", "none"]
        started[name] = (background(accelerate_launch, *odc, "--output_dir", root / name), root / name)
    return started


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_dpo_config_fails_before_training(bad_config_runs, name):
    future, out = bad_config_runs[name]
    proc = future.result()
    assert proc.returncode != 0
    assert BAD_CONFIGS[name][1] in proc.stderr, proc.stderr[-3000:]
    assert not (out / "trainer_state.json").exists()
