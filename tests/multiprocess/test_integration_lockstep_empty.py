"""Plain FSDP2 (ODC off) on the lockstep plan with an unavoidable empty microbatch slot: the SFT example, 2 CPU processes.

5 samples per step and a token budget below every sample (each runs alone in its microbatch): 3 slots per rank for 5
samples, so one rank's third slot has no sample. It runs as a zero-weight microbatch (`StepCollator(pad_empty=True)`)
that keeps FSDP2's per-layer collectives paired: the run finishes (well within the process-group timeout) and trains as
TRL's SFTTrainer does in one process on the same 5 samples per step (the session's ``sft_reference``), its loss,
gradient norm, ``num_tokens`` and token metrics included.
"""

from __future__ import annotations

import pytest
import torch
from integration_utils import (
    CONFIGS,
    SFT_PARITY,
    SFT_SAMPLES_PER_STEP,
    TRAIN,
    accelerate_launch,
    check_ok,
    final_params,
    logged_steps,
    max_rel,
    reports,
)


def test_plain_fsdp2_lockstep_with_an_empty_slot_trains_as_one_process(tmp_path, sft_reference):
    out = tmp_path / "plain_lockstep_empty"
    proc = accelerate_launch(
        CONFIGS / "fsdp2_cpu.yaml",
        TRAIN,
        *SFT_PARITY,
        "--odc_samples_per_step",
        str(SFT_SAMPLES_PER_STEP),
        "--odc_plan",
        "lockstep",
        "--odc_max_tokens_per_microbatch",  # the later value wins: one sample per microbatch
        "1",
        "--save_strategy",
        "no",
        "--output_dir",
        out,
        ODC_DUMP_PARAMS="1",
    )
    check_ok(proc)
    for report in reports(out, "odc_run_rank"):
        assert report["engine"] is None and report["odc_config"]["plan"] == "lockstep", report
    ref_proc, ref = sft_reference
    check_ok(ref_proc)
    steps, ref_steps = logged_steps(out), logged_steps(ref)
    for a, b in zip(steps, ref_steps, strict=True):
        # every rank ran 3 microbatches, one of them of weight 0: 6 slots for 5 samples
        assert a["odc/microbatches_min"] == a["odc/microbatches_max"] == 3, a
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)  # fp32 summation order
        assert a["num_tokens"] == b["num_tokens"]  # the zero-weight sample's tokens are not counted
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-4)
        assert a["mean_token_accuracy"] == pytest.approx(b["mean_token_accuracy"], abs=1e-6)
    trained, expected, init = final_params(out), final_params(ref), torch.load(ref / "initial_params.pt")
    assert max_rel(torch.load(out / "initial_params.pt"), init) == 0.0
    diff = sum(float((trained[k] - expected[k]).norm() ** 2) for k in expected) ** 0.5
    update = sum(float((expected[k] - init[k]).norm() ** 2) for k in expected) ** 0.5
    assert update > 0 and diff / update <= 1e-4, (diff, update)
    assert max_rel(trained, expected) <= 1e-4
