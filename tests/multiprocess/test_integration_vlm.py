"""Vision-language SFT: a tiny Qwen3-VL-shaped model (`odc_accelerate.testing.models.save_tiny_vlm`) on image+text
samples of different image sizes, through the SFT example (`odc-accelerate sft`'s script) under ``accelerate
launch``, 2 CPU processes with ODC and unequal microbatch counts, against TRL's own `SFTTrainer` in one process on
the same samples per step, each step as one microbatch (`tests/helpers/loops/trl_reference.py`).

What it shows: the plan's lengths are the processor's expansions (image tokens counted: the traced microbatch widths
are those of the collated rows), each microbatch's ``pixel_values`` / ``image_grid_thw`` are those of its own
samples (the losses, gradient norms and weights equal one process's), and FSDP2 wraps the vision blocks as well as
the decoder layers.
"""

from __future__ import annotations

import json

import pytest
import torch
from integration_utils import (
    CONFIGS,
    SFT_PARITY,
    SFT_SAMPLES_PER_STEP,
    TRAIN,
    accelerate_launch,
    background,
    check_ok,
    final_params,
    logged_steps,
    max_rel,
    reports,
    results,
    shm_leftovers,
)

SAMPLES = 2 * SFT_SAMPLES_PER_STEP  # two optimizer steps
BUDGET = 160
TINY_VLM = {"ODC_TEST_TINY_VLM": "1", "ODC_DUMP_PARAMS": "1"}


@pytest.fixture(scope="module")
def vlm_runs(tmp_path_factory, references):
    from odc_accelerate.testing.models import save_tiny_vlm, tiny_vlm_dataset

    root = tmp_path_factory.mktemp("vlm")
    model = save_tiny_vlm(root / "model")
    data = tiny_vlm_dataset(SAMPLES, seed=0)
    data.to_parquet(str(root / "data" / "train.parquet"))
    args = [*SFT_PARITY, "--model_name_or_path", str(model), "--dataset_name", str(root / "data")]
    # A budget (later values win) that pairs some samples (2 rows x the longer one) and leaves others alone: an odd
    # number of microbatches per step, some with several images
    args += ["--odc_max_tokens_per_microbatch", str(BUDGET), "--save_strategy", "no"]
    shm_before = shm_leftovers()
    out = {"odc": root / "odc"}
    procs = {
        "odc": background(
            accelerate_launch, CONFIGS / "odc_cpu.yaml", TRAIN, "--odc", "true", *args,
            "--odc_samples_per_step", str(SFT_SAMPLES_PER_STEP), "--output_dir", out["odc"],
            ODC_TRACE_DIR=str(out["odc"] / "trace"), **TINY_VLM,
        )
    }  # fmt: skip
    # Qwen3-VL's forward takes no loss keyword arguments, so TRL's gradient accumulation would average per-microbatch
    # token means; the step as one microbatch (padded rows, which change no token's loss) gives the step's token
    # mean, the loss ODC trains.
    procs["single"], out["single"] = references.start("sft", SFT_SAMPLES_PER_STEP, *args, "--one_microbatch")
    return {"out": out, "procs": results(procs), "data": data, "model": model, "shm_before": shm_before}


def test_vlm_sft_matches_trls_own_trainer_in_one_process(vlm_runs):
    check_ok(vlm_runs["procs"]["odc"])
    check_ok(vlm_runs["procs"]["single"])
    odc, single = vlm_runs["out"]["odc"], vlm_runs["out"]["single"]
    h_odc, h_single = logged_steps(odc), logged_steps(single)
    assert len(h_odc) == 2
    for a, b in zip(h_odc, h_single, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["num_tokens"] == b["num_tokens"]
    assert any(h["odc/microbatches_min"] != h["odc/microbatches_max"] for h in h_odc), "ranks ran equal counts"
    a, b, init = final_params(odc), final_params(single), torch.load(single / "initial_params.pt")
    assert max_rel(torch.load(odc / "initial_params.pt"), init) == 0.0
    vision = [k for k in a if ".visual." in k]
    assert vision and all(not torch.equal(b[k], init[k]) for k in vision if k.endswith("qkv.weight"))  # it trained
    diff = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    update = sum(float((b[k] - init[k]).norm() ** 2) for k in b) ** 0.5
    vdiff = sum(float((a[k] - b[k]).norm() ** 2) for k in vision) ** 0.5
    vupdate = sum(float((b[k] - init[k]).norm() ** 2) for k in vision) ** 0.5
    assert update > 0 and diff / update <= 1e-4, (diff, update)
    assert vupdate > 0 and vdiff / vupdate <= 1e-4, (vdiff, vupdate)  # the vision tower on its own
    print(
        f"VLM SFT: |diff| / |update| = {diff / update:.2e} (vision tower {vdiff / vupdate:.2e}), max rel {max_rel(a, b):.2e}"
    )
    # FSDP2 wrapped the vision blocks and the decoder layers (transformers' _no_split_modules), each its own unit
    for r in reports(odc, "odc_run_rank"):
        assert r["engine"] == "ODCEngine"
        # (fully_shard gives each wrapped module a class FSDP<its class>); the final norm and the LM head
        # (FSDPLinear) share a group, so the norm's forward unshards the head TRL's fused LM head reads
        wrapped = {"FSDPQwen3VLVisionBlock", "FSDPQwen3VLTextDecoderLayer", "FSDPQwen3VLTextRMSNorm", "FSDPLinear"}
        assert wrapped <= set(r["fsdp_module_classes"]), r["fsdp_module_classes"]
    assert shm_leftovers() <= vlm_runs["shm_before"], "shared memory left behind"


def test_vlm_plan_counts_image_tokens_and_pixels_travel_with_their_samples(vlm_runs):
    """The traced microbatches hold the collated rows: their padded widths are the longest expanded sample of each
    (text and image tokens), which the plan kept within the token budget; each holds the ``pixel_values`` rows of its
    own samples' images (``prod(image_grid_thw)`` per image), and over a step every image is in one microbatch."""
    from transformers import AutoProcessor
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from odc_accelerate.testing.models import register_tiny_vlm_processor

    check_ok(vlm_runs["procs"]["odc"])
    register_tiny_vlm_processor()
    collator = DataCollatorForVisionLanguageModeling(AutoProcessor.from_pretrained(vlm_runs["model"]), max_length=128)
    data = vlm_runs["data"]
    alone = [collator([dict(data[i])]) for i in range(len(data))]
    expanded = [int(b["attention_mask"].sum()) for b in alone]
    patches = sum(int(b["image_grid_thw"].prod(dim=-1).sum()) for b in alone)
    out = vlm_runs["out"]["odc"]
    steps = [
        json.loads(line) for r in (0, 1) for line in (out / "trace" / f"trace_rank{r}.jsonl").read_text().splitlines()
    ]
    microbatches = [mb for step in steps for mb in step["microbatches"]]
    assert sum(mb["rows"] for mb in microbatches) == SAMPLES
    widths = sorted(mb["width"] for mb in microbatches)
    # every width is some sample's expanded length, and each microbatch (rows x width) fits the budget
    assert set(widths) <= set(expanded), (widths, expanded)
    assert all(mb["rows"] * mb["width"] <= BUDGET for mb in microbatches), microbatches
    assert max(expanded) > 2 * min(expanded) - 20  # lengths vary with the images: a plan on text alone would differ
    # one image per sample; each microbatch's pixel rows are its own images' patches, and every patch is trained once
    assert all(mb["images"] == mb["rows"] and mb["pixel_rows"] == mb["patches"] for mb in microbatches)
    assert any(mb["rows"] > 1 for mb in microbatches)  # some microbatch concatenates several images' pixel rows
    assert sum(mb["patches"] for mb in microbatches) == patches
