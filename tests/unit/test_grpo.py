"""GRPO under ODC, one process: re-batching completions, loss weights, refusals, step-level metric reductions."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from odc_accelerate._compat.trl import grpo as trl_grpo  # noqa: E402
from odc_accelerate.config import ODCConfig  # noqa: E402
from odc_accelerate.integrations.trainer.metrics import DeferredGather, reduce_step_metrics  # noqa: E402
from odc_accelerate.integrations.trl.grpo import check_grpo_args, finalize_grpo_metrics, grpo_loss_weight
from odc_accelerate.integrations.trl.rollouts import collate_rollouts, split_rollouts  # noqa: E402

PAD = 7


def _trl_batch() -> dict:
    """A generation batch as TRL pads it: prompts on the left, completions on the right."""
    prompts = [[11, 12, 13], [21], [31, 32]]
    completions = [[101, 102], [201, 202, 203, 204], []]
    width_p, width_c = 3, 4
    batch = {
        "prompt_ids": torch.tensor([[PAD] * (width_p - len(p)) + p for p in prompts]),
        "prompt_mask": torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts]),
        "completion_ids": torch.tensor([c + [PAD] * (width_c - len(c)) for c in completions]),
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in completions]),
        "advantages": torch.tensor([0.5, -1.0, 0.25]),
        "ref_per_token_logps": torch.arange(12, dtype=torch.float32).reshape(3, 4) * 0.1,
        "num_items_in_batch": torch.tensor(6),
    }
    batch["ref_per_token_logps"] = batch["ref_per_token_logps"] * batch["completion_mask"]
    return batch


def test_split_then_collate_reproduces_the_padded_batch():
    batch = _trl_batch()
    rows = split_rollouts(batch)
    assert [r["prompt_ids"].tolist() for r in rows] == [[11, 12, 13], [21], [31, 32]]
    assert [r["completion_ids"].tolist() for r in rows] == [[101, 102], [201, 202, 203, 204], []]
    assert [float(r["advantages"]) for r in rows] == [0.5, -1.0, 0.25]
    again = collate_rollouts(rows, PAD, "cpu")
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "ref_per_token_logps"):
        torch.testing.assert_close(again[key], batch[key], msg=key)
    # a microbatch of some rows is padded to its own widths; a completion-less microbatch keeps one column
    part = collate_rollouts([rows[2]], PAD, "cpu")
    assert part["prompt_ids"].tolist() == [[31, 32]]
    assert part["completion_ids"].tolist() == [[PAD]] and part["completion_mask"].tolist() == [[0]]


def _with_importance_sampling(batch: dict, per_sequence: bool) -> dict:
    """TRL's vLLM importance-sampling inputs: the sampling log-probs per token, and the ratio per token (``token_*``
    modes, 1.0 beyond each completion as TRL computes it) or per completion (``sequence_*`` modes, shape (B, 1))."""
    mask = batch["completion_mask"]
    batch["sampling_per_token_logps"] = -torch.arange(1, 13, dtype=torch.float32).reshape(3, 4) * 0.01 * mask
    if per_sequence:
        batch["importance_sampling_ratio"] = torch.tensor([[0.9], [1.1], [1.0]])
    else:
        ratio = 1.0 + 0.01 * torch.arange(12, dtype=torch.float32).reshape(3, 4)
        batch["importance_sampling_ratio"] = torch.where(mask.bool(), ratio, torch.ones_like(ratio))
    return batch


@pytest.mark.parametrize("per_sequence", [False, True], ids=["token_modes", "sequence_modes"])
def test_vllm_importance_sampling_inputs_follow_each_completion(per_sequence):
    batch = _with_importance_sampling(_trl_batch(), per_sequence)
    keys = ("importance_sampling_ratio",) if per_sequence else ()
    rows = split_rollouts(batch, keys)
    if per_sequence:
        assert [r["importance_sampling_ratio"].tolist() for r in rows] == [
            pytest.approx([0.9]),
            pytest.approx([1.1]),
            pytest.approx([1.0]),
        ]
    else:
        assert [r["importance_sampling_ratio"].numel() for r in rows] == [2, 4, 0]
    again = collate_rollouts(rows, PAD, "cpu", keys)
    for key in ("sampling_per_token_logps", "importance_sampling_ratio", "completion_ids", "advantages"):
        torch.testing.assert_close(again[key], batch[key], msg=key)
    # re-batched in another order and grouping, each completion keeps its own values
    part = collate_rollouts([rows[2], rows[0]], PAD, "cpu", keys)
    if per_sequence:
        assert part["importance_sampling_ratio"].tolist() == [pytest.approx([1.0]), pytest.approx([0.9])]
    else:
        expected = batch["importance_sampling_ratio"][[2, 0], :2]
        torch.testing.assert_close(part["importance_sampling_ratio"], expected)
    torch.testing.assert_close(part["sampling_per_token_logps"], batch["sampling_per_token_logps"][[2, 0], :2])


def test_split_refuses_importance_ratios_of_the_wrong_shape():
    batch = _with_importance_sampling(_trl_batch(), per_sequence=True)
    with pytest.raises(ValueError, match=r"one `importance_sampling_ratio` value per completion token"):
        split_rollouts(batch)  # (B, 1) read as per token: the trainer says which keys are per completion
    batch = _with_importance_sampling(_trl_batch(), per_sequence=False)
    with pytest.raises(ValueError, match=r"one `importance_sampling_ratio` value per completion here"):
        split_rollouts(batch, ("importance_sampling_ratio",))


def test_split_refuses_what_it_cannot_rebatch():
    batch = _trl_batch()
    batch["pixel_values"] = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=r"pixel_values.*--odc_plan"):
        split_rollouts(batch)
    batch = _trl_batch()
    batch["advantages"] = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="one `advantages` value per completion"):
        split_rollouts(batch)


def _trainer(loss_type: str, ga: int = 1, spg: int = 1, trl_ga: int | None = None) -> SimpleNamespace:
    """A trainer running ``ga`` accumulation steps (1 under a plan) of TRL's ``trl_ga`` (default: ``spg``)."""
    return SimpleNamespace(
        loss_type=loss_type,
        current_gradient_accumulation_steps=ga,
        args=SimpleNamespace(steps_per_generation=spg),
        odc_run=SimpleNamespace(folded_accumulation=spg if trl_ga is None else trl_ga),
        beta=0.0,
    )


@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "luspo", "dr_grpo"])
def test_sequence_mean_types_weigh_by_rows(loss_type):
    # 3 of 12 completions in this microbatch, 2 ranks: (1/3) sum over its rows -> (2/12) sum
    w = grpo_loss_weight(_trainer(loss_type), rows=3, tokens=40, total_rows=12, total_tokens=100, world_size=2)
    assert w == pytest.approx(3 * 2 / 12)


def test_token_mean_type_weighs_by_tokens():
    w = grpo_loss_weight(_trainer("bnpo"), rows=3, tokens=40, total_rows=12, total_tokens=100, world_size=2)
    assert w == pytest.approx(40 * 2 / 100)


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
@pytest.mark.parametrize(("trl_ga", "spg"), [(4, 4), (1, 4), (2, 4)])
def test_global_token_types_undo_trls_accumulation_scaling(loss_type, trl_ga, spg):
    # TRL's microbatch: sum / (num_items / world x ga / spg), num_items the generation batch's loss tokens (100), each
    # of the spg / ga steps of the generation batch the sum over its ga slices on each rank, averaged over ranks.
    world, num_items, tokens = 2, 100.0, 40.0
    trl = tokens / (num_items / world * trl_ga / spg)
    # Under a plan: one accumulation step, TRL's loss computed with current_gradient_accumulation_steps = 1
    odc = tokens / (num_items / world * 1 / spg)
    w = grpo_loss_weight(
        _trainer(loss_type, ga=1, spg=spg, trl_ga=trl_ga), rows=3, tokens=tokens, total_rows=12, total_tokens=60,
        world_size=world,
    )  # fmt: skip
    # the ga microbatches of a TRL step on a rank add up to one ODC step's: each microbatch x w = its TRL share x ga / ga
    assert odc * w == pytest.approx(trl)


def test_every_trl_loss_type_has_a_weight():
    """The loss types TRL lists as supported are exactly those with an exact rescaling (a new TRL type fails here)."""
    import re

    from trl import GRPOConfig

    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    supported = help_text.split("Supported values are", 1)[1].split(".", 1)[0]
    assert set(re.findall(r"'(\w+)'", supported)) == set(trl_grpo.GRPO_LOSS_NORMALISATION)


def _args(**overrides):
    base = dict(
        use_vllm=False,
        vllm_mode="colocate",
        vllm_tensor_parallel_size=1,
        sync_ref_model=False,
        loss_type="grpo",
        num_iterations=1,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        entropy_coef=0.0,
        use_adaptive_entropy=False,
        top_entropy_quantile=1.0,
    )
    base.update(overrides)
    return SimpleNamespace(**base)


BALANCED = ODCConfig(enable=True, plan="free")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"use_vllm": True, "vllm_tensor_parallel_size": 2}, "--vllm_tensor_parallel_size 1"),
        ({"sync_ref_model": True}, "--sync_ref_model false"),
        ({"loss_type": "made_up"}, r"Use one of \['bnpo'"),
        ({"steps_per_generation": 1}, "steps_per_generation=1 is below gradient_accumulation_steps=2"),
        ({"steps_per_generation": 3}, "steps_per_generation=3 is not a multiple of gradient_accumulation_steps=2"),
        ({"entropy_coef": 0.01}, "--entropy_coef 0"),
        ({"use_adaptive_entropy": True}, "--entropy_coef 0"),
        ({"top_entropy_quantile": 0.2}, "--top_entropy_quantile 1.0"),
    ],
)
def test_refusals_name_the_fix(overrides, match):
    check_grpo_args(_args(), BALANCED)  # the defaults pass
    # several updates per generation batch: served
    check_grpo_args(_args(num_iterations=3, steps_per_generation=4), BALANCED)
    with pytest.raises(ValueError, match=match):
        check_grpo_args(_args(**overrides), BALANCED)


def test_vllm_colocate_runs_under_odc_with_its_plan():
    check_grpo_args(_args(use_vllm=True), BALANCED)
    check_grpo_args(_args(use_vllm=True, vllm_mode="colocate"), ODCConfig(enable=True, plan="lockstep"))


@pytest.mark.parametrize("config", [BALANCED, ODCConfig(enable=True, plan="dynamic"), ODCConfig(enable=True)])
def test_vllm_server_mode_runs_under_odc_with_the_servers_own_parallelism(config):
    # rank 0 pushes the full weights to the server (odc_accelerate.integrations.vllm_server); the server's tensor
    # parallelism is its own, so vllm_tensor_parallel_size (a colocate setting) is not refused there
    check_grpo_args(_args(use_vllm=True, vllm_mode="server"), config)
    check_grpo_args(_args(use_vllm=True, vllm_mode="server", vllm_tensor_parallel_size=2), config)


def test_vllm_server_mode_and_tensor_parallelism_stay_trls_without_odc():
    # plain FSDP2, with or without a plan: TRL's own vLLM weight sync and generation
    for config in (ODCConfig(enable=False, plan=None), ODCConfig(enable=False, plan="lockstep")):
        check_grpo_args(_args(use_vllm=True, vllm_mode="server"), config)
        check_grpo_args(_args(use_vllm=True, vllm_tensor_parallel_size=2), config)


def test_plain_fsdp2_without_a_plan_keeps_trls_options():
    # TRL's own microbatches: every loss type and setting is TRL's
    plain = ODCConfig(enable=False, plan=None)
    check_grpo_args(_args(entropy_coef=0.1, num_iterations=3, top_entropy_quantile=0.5, use_vllm=True), plain)
    check_grpo_args(_args(steps_per_generation=1), plain)
    # plain FSDP2 on a plan has the plan's limits
    with pytest.raises(ValueError, match="Set --steps_per_generation to a multiple of --gradient_accumulation_steps"):
        check_grpo_args(_args(steps_per_generation=1), ODCConfig(enable=False, plan="lockstep"))


def test_deferred_reduce_and_gather_give_step_ratios_minima_and_maxima():
    """Two ranks' microbatches, combined as the step boundary does, against the values over all of them at once."""
    rank_values = [
        [
            (torch.tensor([3.0, 4.0]), torch.tensor([0.1, float("nan"), 0.5])),
            (torch.tensor([1.0, 1.0]), torch.tensor([0.2])),
        ],
        [(torch.tensor([6.0, 5.0]), torch.tensor([0.9, 0.05]))],
    ]
    rows = []
    for microbatches in rank_values:
        deferred = DeferredGather()
        for pair, per_sequence in microbatches:
            deferred.start_microbatch()
            assert torch.equal(deferred.reduce(pair, reduction="sum"), pair)  # answered locally
            deferred(per_sequence)
        captured = []
        reduce_step_metrics(deferred, lambda t, c=captured: c.append(t) or t, "cpu")
        rows.append(captured[0])
    everyone = torch.cat(rows)
    metrics = reduce_step_metrics(_replay(rank_values[0]), lambda t: everyone, "cpu")
    assert metrics.global_sums[0] == pytest.approx(3 + 1 + 6) and metrics.global_counts[0] == pytest.approx(4 + 1 + 5)
    assert metrics.global_mins[1] == pytest.approx(0.05) and metrics.global_maxs[1] == pytest.approx(0.9)
    assert metrics.local_microbatches == 2 and metrics.global_microbatches == 3 and metrics.gathers_per_microbatch == 2
    assert math.isnan(metrics.global_mins[0])  # a [sum, count] reduce has no extremes


def _replay(microbatches):
    deferred = DeferredGather()
    for pair, per_sequence in microbatches:
        deferred.start_microbatch()
        deferred.reduce(pair)
        deferred(per_sequence)
    return deferred


@pytest.mark.parametrize("aux", [False, True])
def test_finalize_replaces_per_microbatch_values_with_the_steps(aux):
    """Each metric's step value over every rank; a MoE router's ``aux_loss`` (gathered first, each microbatch's value
    weighted by its share of the step's routed tokens) is their sum."""
    trainer = _trainer("grpo")
    trainer.beta = 0.1
    trainer.aux_loss_enabled = aux
    calls = trl_grpo.grpo_metric_calls(trainer)
    first = ["aux_loss", "kl", "entropy"] if aux else ["kl", "entropy"]
    assert [name for name, _ in calls[: len(first)]] == first
    recorded = {name: [99.0, 1.0, 2.0] for name, _ in calls}  # 99: an earlier step's value
    recorded["step_time"] = [5.0, 0.5, 0.25]
    trainer._metrics = {"train": recorded}
    n = len(calls)
    metrics = SimpleNamespace(
        local_microbatches=2,
        global_sums=[float(i + 1) for i in range(n)],
        global_counts=[2.0] * n,
        global_mins=[-float(i) for i in range(n)],
        global_maxs=[10.0 + i for i in range(n)],
    )
    finalize_grpo_metrics(trainer, metrics)
    for i, (name, how) in enumerate(calls):
        expected = {"ratio": (i + 1) / 2.0, "min": -float(i), "max": 10.0 + i, "sum": float(i + 1)}[how]
        assert recorded[name] == [99.0, expected], name
    assert recorded["step_time"] == [5.0, 0.75]


@pytest.mark.parametrize("refused", ["tensor_parallel", "alora"])
def test_the_trainer_refuses_vllm_settings_before_any_engine(tmp_path, refused):
    """The real trainer stops in its set-up, before TRL would create an engine: here vLLM is not even installed. A
    PEFT adapter the weight sync cannot merge is refused there too, by name."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, Qwen2Config

    from odc_accelerate.demo import load_offline_tokenizer, offline_vocab_size
    from odc_accelerate.integrations.trl import ODCGRPOConfig, ODCGRPOTrainer

    sizes = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    model = AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=offline_vocab_size(), **sizes))
    args = ODCGRPOConfig(
        output_dir=str(tmp_path),
        odc=True,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_tensor_parallel_size=2 if refused == "tensor_parallel" else 1,
        per_device_train_batch_size=4,
        num_generations=4,
        report_to="none",
    )
    error, match = {
        "tensor_parallel": (ValueError, "vllm_tensor_parallel_size=2"),
        "alora": (NotImplementedError, "q_proj: adapter 'default' is the LoRA variant ALoraLinearVariant"),
    }[refused]
    alora = {"alora_invocation_tokens": [5, 6]}  # aLoRA: a LoRA variant PEFT cannot merge
    peft_config = LoraConfig(r=4, target_modules=["q_proj"], **alora) if refused == "alora" else None
    with pytest.raises(error, match=match):
        ODCGRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["one two three"] * 8}),
            processing_class=load_offline_tokenizer(),
            peft_config=peft_config,
        )


def test_generation_without_peer_sync_reaches_generate_through_a_wrapper(monkeypatch):
    """A PEFT model's ``generate(*args, **kwargs)`` passes ``synced_gpus`` on: the check reads transformers' own
    signature, and the wrapper sets ``synced_gpus=False`` without ODC's peers; a transformers without it is named."""
    import contextlib

    import transformers

    from odc_accelerate._compat import CompatError
    from odc_accelerate._compat.transformers import generation_without_peer_sync

    seen = []

    class Wrapper:  # what peft.PeftModelForCausalLM.generate looks like
        def generate(self, *args, **kwargs):
            seen.append(kwargs.get("synced_gpus"))
            return "out"

    model = Wrapper()
    with generation_without_peer_sync(model, sync=False, around=contextlib.nullcontext):
        assert model.generate(input_ids=None) == "out"
    with generation_without_peer_sync(model, sync=True, around=contextlib.nullcontext):
        model.generate(input_ids=None)
    assert seen == [False, None] and "generate" not in vars(model)  # removed at the end of the block

    monkeypatch.setattr(transformers.GenerationMixin, "generate", lambda self, *args, **kwargs: None)
    with pytest.raises(CompatError, match=r"GenerationMixin\.generate\(synced_gpus=\.\.\.\)"):
        with generation_without_peer_sync(model, sync=False, around=contextlib.nullcontext):
            pass


@pytest.mark.parametrize("odc", [False, True], ids=["plain_fsdp2", "odc"])
def test_an_empty_lockstep_slot_is_a_zero_weight_copy_of_a_real_completion(monkeypatch, odc):
    """Plain FSDP2 runs an empty slot of the lockstep plan as a `ZeroWeightMicrobatch` of one of the rank's completions,
    unchanged (its mask, advantage and log-probs: TRL's loss on it is finite, and the step loop scales it by 0); ODC
    needs no filler."""
    from odc_accelerate.integrations.trainer.data import ZeroWeightMicrobatch
    from odc_accelerate.integrations.trl.grpo import ODCGRPOTrainer
    from odc_accelerate.planning import StreamingStepPlanner

    batch = _trl_batch()
    monkeypatch.setattr(StreamingStepPlanner, "plan", lambda self, lengths: [[[0, 1], []], [[2], [0]]])
    trainer = object.__new__(ODCGRPOTrainer)
    trainer.__dict__.update(
        use_vllm=False,
        accelerator=SimpleNamespace(
            num_processes=2, process_index=0, device=torch.device("cpu"), unwrap_model=lambda m: m
        ),
        model=SimpleNamespace(),
        args=SimpleNamespace(per_device_train_batch_size=2),
        max_completion_length=4,
        odc_config=ODCConfig(enable=odc, plan="lockstep", max_tokens_per_microbatch=64),
        odc_step_timer=SimpleNamespace(add_work=lambda *a: None),
        _tokenizer=SimpleNamespace(pad_token_id=PAD),
        _odc_generation_items=None,
    )
    microbatches = ODCGRPOTrainer._odc_plan(trainer, split_rollouts(batch))  # this batch is the step's, gathered
    assert microbatches[0]["odc_rows"] == 2 and not isinstance(microbatches[0], ZeroWeightMicrobatch)
    if odc:
        assert len(microbatches) == 1
        return
    filler = microbatches[1]
    assert isinstance(filler, ZeroWeightMicrobatch) and filler.batch["odc_rows"] == 0
    own = collate_rollouts(split_rollouts(batch)[1:2], PAD, "cpu")  # the rank's last completion of the step
    for key, value in own.items():
        assert torch.equal(filler.batch[key], value), key
    assert filler.batch["completion_mask"].sum() == 4 and float(filler.batch["advantages"]) == -1.0
