"""Vision-language SFT under a plan (`odc_accelerate.testing.models.save_tiny_vlm`): each image+text sample's length
is the one its processor expands it to, and GRPO / RLOO with images are refused by name before any work."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import requires_hf_current


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from odc_accelerate.testing.models import register_tiny_vlm_processor, save_tiny_vlm, tiny_vlm_dataset

    register_tiny_vlm_processor()
    return save_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model"), tiny_vlm_dataset(6, seed=1)


@requires_hf_current
def test_saved_tiny_vlm_loads_offline_and_trains_on_images(vlm):
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from odc_accelerate.testing.models import VLM_MERGE

    path, dataset = vlm
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    batch = DataCollatorForVisionLanguageModeling(processor)([dict(dataset[i]) for i in range(3)])
    grid = batch["image_grid_thw"]
    # pixel_values: one row per patch of every image of the batch; each image's tokens are its patches / merge^2
    assert batch["pixel_values"].shape[0] == int(grid.prod(dim=-1).sum())
    image_tokens = (batch["input_ids"] == model.config.image_token_id).sum(dim=1)
    assert image_tokens.tolist() == (grid.prod(dim=-1) // VLM_MERGE**2).tolist()
    assert len(set(image_tokens.tolist())) > 1  # images of different sizes
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.visual.blocks[0].attn.qkv.weight.grad.abs().sum() > 0


def _sft_trainer(tmp_path, path, dataset, **kwargs):
    from odc_accelerate import ODCSFTConfig, ODCSFTTrainer

    args = ODCSFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_length=None,
        report_to="none",
        bf16=False,
        odc=False,
        **kwargs,
    )
    return ODCSFTTrainer(model=str(path), args=args, train_dataset=dataset)


@requires_hf_current
def test_plan_counts_each_samples_image_tokens(tmp_path, vlm):
    from transformers import AutoProcessor

    path, dataset = vlm
    trainer = _sft_trainer(tmp_path, path, dataset)
    lengths = trainer._odc_lengths(trainer.train_dataset)
    # Independently: each sample through the processor alone (its chat template, images expanded), no padding.
    processor = AutoProcessor.from_pretrained(path)
    image_id = trainer.model.config.image_token_id
    expected, image_tokens = [], []
    for row in dataset:
        ids = processor.apply_chat_template(
            [row["messages"]], tokenize=True, return_dict=True, images=[row["images"]], add_generation_prompt=False
        )["input_ids"]
        ids = ids[0] if isinstance(ids[0], list) else ids
        expected.append(len(ids))
        image_tokens.append(sum(t == image_id for t in ids))
    assert lengths.tolist() == expected
    assert min(image_tokens) >= 1 and len(set(image_tokens)) > 1
    assert trainer._odc_padded()  # TRL's vision collator pads each microbatch's rows: the plan counts padded shapes


@pytest.mark.parametrize("trainer", ["GRPO", "RLOO"])
def test_online_trainers_refuse_prompts_with_images_under_a_plan_at_set_up(tmp_path, vlm, monkeypatch, trainer):
    """GRPO / RLOO re-batch the generated completions under a plan, which cannot carry their images yet: refused by
    name in the set-up, before gradient accumulation is folded, any model sharded or any engine built."""
    from odc_accelerate.integrations.trl import (
        ODCGRPOConfig,
        ODCGRPOTrainer,
        ODCRLOOConfig,
        ODCRLOOTrainer,
        online_checks,
    )

    path, dataset = vlm
    prompts = dataset.map(lambda row: {"prompt": row["messages"][:1]}, remove_columns=["messages"])
    config_class, trainer_class = {"GRPO": (ODCGRPOConfig, ODCGRPOTrainer), "RLOO": (ODCRLOOConfig, ODCRLOOTrainer)}[
        trainer
    ]
    args = config_class(
        output_dir=str(tmp_path),
        odc=True,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        report_to="none",
        bf16=False,
    )
    checked = []
    original = online_checks.check_no_images
    monkeypatch.setattr(
        f"odc_accelerate.integrations.trl.{trainer.lower()}.check_no_images",
        lambda *a: checked.append(a[1]) or original(*a),
    )
    with pytest.raises(ValueError, match=f"{trainer} on prompts with images is not supported under an ODC plan") as e:
        trainer_class(
            model=str(path),
            reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
            args=args,
            train_dataset=prompts,
        )
    assert "Run without --odc / --odc_plan" in str(e.value) and "pixel_values" in str(e.value)
    assert checked == [trainer]  # in the set-up's checks, once


def test_has_images_reads_every_vision_format():
    from odc_accelerate.integrations.trl.online_checks import has_images

    image_part = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
    assert has_images({"prompt": "text", "image": object()})
    assert has_images({"prompt": "text", "images": [object()]})
    assert has_images({"prompt": image_part})
    assert not has_images({"prompt": [{"role": "user", "content": "text only"}], "images": []})
    assert not has_images({"prompt": "text"})


def test_fsdp2_groups_a_vlms_lm_head_with_its_language_models_final_norm():
    """accelerate puts the LM head in one FSDP2 group with the final norm it finds among the base model's children,
    so that the norm's forward unshards the head before TRL's fused LM head reads its weight. A Qwen3-VL's base model
    holds ``visual`` and ``language_model``: the norm is the language model's. Without it the head would be gathered
    with ``full_tensor()`` in every microbatch (a collective) and get its gradient through that gather."""
    from accelerate.utils import fsdp_utils
    from transformers import Qwen3VLForConditionalGeneration

    from odc_accelerate.integrations.accelerate import enable
    from odc_accelerate.testing.models import tiny_vlm_config

    enable()
    model = Qwen3VLForConditionalGeneration(tiny_vlm_config(hidden_size=16))
    assert fsdp_utils._find_final_norm(model) is model.model.language_model.norm
