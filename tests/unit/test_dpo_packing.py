"""DPO without padding (`odc_accelerate.integrations.trl.packing`): a microbatch's pairs packed into one row give the
per-sequence log-probs, the other per-token outputs and the gradients of TRL's padded rows; what cannot pack says why.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM
from trl.trainer import dpo_trainer
from trl.trainer.dpo_trainer import DataCollatorForPreference

from odc_accelerate._compat.trl.lm_head import fused_lm_head_torch_path
from odc_accelerate.integrations.trl.packing import (
    PackedPairs,
    pack_rows,
    packed_forward,
    padded_view,
    pair_packing_obstacle,
)
from odc_accelerate.testing.models import tiny_causal_lm_config

FIELDS = ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")


def _pairs(seed: int = 1) -> list[dict]:
    """Three pairs of unequal lengths: every row of TRL's batch but one is padded."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(5, 200, (n,), generator=g).tolist()

    shapes = [(5, 7, 3), (9, 2, 11), (4, 4, 4)]
    return [{"prompt_ids": ids(p), "chosen_ids": ids(c), "rejected_ids": ids(r)} for p, c, r in shapes]


def _model(kind: str, attention: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_causal_lm_config(kind, hidden_size=32), dtype=torch.float32, attn_implementation=attention
    )
    # TRL's kernel needs Triton's GPU driver; TRL 1.15 has no CPU path of its own: ODC routes it (`_compat.trl.lm_head`)
    with fused_lm_head_torch_path("dpo"):
        dpo_trainer.add_fused_lm_head(model, outputs=FIELDS)
    return model


def _forward(model, batch):
    """TRL's DPO forward (`DPOTrainer._compute_loss`) on its padded batch, and the gradient of the log-prob sum."""
    model.zero_grad()
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        use_cache=False,
        labels=labels,
        fused_lm_head=True,
    )
    out.log_probs.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize(
    ("kind", "attention"), [("untied", "sdpa"), ("untied", "eager"), ("tied", "sdpa"), ("moe", "sdpa")]
)
def test_packed_pairs_give_the_padded_rows_log_probs_and_gradients(kind, attention):
    collator = DataCollatorForPreference(pad_token_id=0)
    features = _pairs()
    padded = collator(features)
    assert (padded["attention_mask"] == 0).any()  # padding to remove
    model = _model(kind, attention)
    reference, reference_grads = _forward(model, padded)

    seen = []
    embed = model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    with packed_forward([model]) as ran:
        # what the trainer hands TRL: the padded view of the packed microbatch
        packed, grads = _forward(model, padded_view(PackedPairs(collator)(features)))
    embed.remove()
    real = int(padded["attention_mask"].sum())
    assert seen == [torch.Size([1, real])] and ran == [(6, real)]  # the model ran one packed row

    # per-sequence log-prob sums (TRL's chosen / rejected logps) to fp32 noise, every other per-token output too
    sums, expected = packed.log_probs.sum(dim=1), reference.log_probs.sum(dim=1)
    assert expected.abs().min() > 1.0
    assert (sums - expected).abs().max() <= 1e-5 * expected.abs().max()
    for name in FIELDS:
        a, b = getattr(packed, name), getattr(reference, name)
        assert a.shape == b.shape, name
        assert torch.allclose(a.float(), b.float(), atol=1e-5, rtol=1e-5), name
    assert grads.keys() == reference_grads.keys()
    for name, grad in reference_grads.items():
        assert torch.allclose(grads[name], grad, atol=1e-5, rtol=1e-4), name

    # the control: the same packed row without the sequences kept apart (one sequence of all the tokens) differs
    row = pack_rows(padded)
    mixed = model(input_ids=row["input_ids"], use_cache=False).logits
    apart = model(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits
    assert (mixed - apart).abs().max() > 1e-3


def test_a_packed_microbatch_round_trips_to_trls_padded_rows():
    collator = DataCollatorForPreference(pad_token_id=0)
    features = [{**f, "ref_chosen_logps": -1.0 * i, "ref_rejected_logps": -2.0 * i} for i, f in enumerate(_pairs())]
    padded = collator(features)
    packed = PackedPairs(collator)(features)
    assert "attention_mask" not in packed and packed["input_ids"].shape == (1, int(padded["attention_mask"].sum()))
    assert packed["position_ids"][0].tolist()[:13] == list(range(12)) + [0]  # prompt 5 + chosen 7, then the next row
    view = padded_view(packed)
    for key in ("input_ids", "attention_mask", "completion_mask", "ref_chosen_logps", "ref_rejected_logps"):
        assert torch.equal(view[key], padded[key]), key
    assert padded_view(padded) is padded  # a padded batch (evaluation) is left as it is


def test_rows_a_packed_row_cannot_hold_are_refused_with_what_to_change():
    padded = DataCollatorForPreference(pad_token_id=0)(_pairs())
    left = {**padded, "attention_mask": padded["attention_mask"].flip(1)}
    with pytest.raises(ValueError, match="left-padded or empty.*--padding_free false"):
        pack_rows(left)
    # a forward on such rows is not packed: it runs padded
    model = _model("untied", "sdpa")
    with packed_forward([model]) as ran:
        model(**{k: left[k] for k in ("input_ids", "attention_mask")}, labels=left["input_ids"], fused_lm_head=True)
    assert ran == []


def test_what_cannot_pack_says_why(monkeypatch):
    from odc_accelerate import hybrid

    def trainer(model, vision=False):
        return SimpleNamespace(model=model, _is_vision_dataset=vision)

    assert pair_packing_obstacle(trainer(_model("untied", "sdpa"))) is None
    eager = _model("untied", "eager")
    assert pair_packing_obstacle(trainer(eager)) is None
    assert "images" in pair_packing_obstacle(trainer(eager, vision=True))
    eager.config._attn_implementation = "paged|sdpa"
    assert "attention implementation 'paged|sdpa' is not one known" in pair_packing_obstacle(trainer(eager))
    recurrent = AutoModelForCausalLM.from_config(tiny_causal_lm_config("hybrid", hidden_size=32))
    monkeypatch.setattr(hybrid, "_installed", lambda name: False)
    why = pair_packing_obstacle(trainer(recurrent))
    assert "recurrent" in why and "flash-linear-attention and causal-conv1d" in why
    monkeypatch.setattr(hybrid, "_installed", lambda name: True)
    assert pair_packing_obstacle(trainer(recurrent)) is None  # with the kernels: packed, with the boundaries


def test_trls_warning_that_it_pads_is_left_out_only_while_odc_packs(caplog):
    from odc_accelerate._compat.trl import dpo as trl_dpo

    logger = logging.getLogger("trl.trainer.dpo_trainer")  # under accelerate's adapter, which prefixes the rank
    message = "[RANK 0] `padding_free=True` is temporarily unavailable after a refactor and is currently disabled."
    with caplog.at_level(logging.WARNING, logger="trl.trainer.dpo_trainer"):
        with trl_dpo.padding_free_warning_silenced():
            logger.warning(message)
            logger.warning("another warning")
        logger.warning(message)
    assert [r.getMessage().endswith(message) for r in caplog.records] == [False, True]
    assert "log_probs" in trl_dpo.fused_per_token_fields()


def test_the_odc_dpo_config_describes_padding_free_as_served():
    import dataclasses

    from transformers import HfArgumentParser

    from odc_accelerate.integrations.trl import ODCDPOConfig

    (args,) = HfArgumentParser(ODCDPOConfig).parse_args_into_dataclasses(
        ["--output_dir", "x", "--padding_free", "true"]
    )
    assert args.padding_free is True
    (field,) = [f for f in dataclasses.fields(ODCDPOConfig) if f.name == "padding_free"]
    assert "ODC's serves it" in field.metadata["help"] and "Temporarily unavailable" not in field.metadata["help"]
