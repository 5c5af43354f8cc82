"""RLOO under ODC, one process: refusals, the loss weight, the step's metrics, and the advantages of TRL's own code path
on fixed rewards, whichever rank holds each group."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl import RLOOTrainer

from odc_accelerate._compat.trl import classes as trl_classes
from odc_accelerate._compat.trl import grpo as trl_grpo
from odc_accelerate._compat.trl import rloo as trl_rloo
from odc_accelerate.config import ODCConfig
from odc_accelerate.integrations.trainer.data import ZeroWeightMicrobatch
from odc_accelerate.integrations.trainer.metrics import DeferredGather, reduce_step_metrics
from odc_accelerate.integrations.trl.rloo import (
    RLOO_KEYS,
    ODCRLOOTrainer,
    check_rloo_args,
    finalize_rloo_metrics,
    rloo_loss_weight,
)
from odc_accelerate.integrations.trl.rollouts import collate_rollouts, split_rollouts

BALANCED = ODCConfig(enable=True, plan="free")


def _args(**overrides):
    base = dict(
        use_vllm=False,
        vllm_mode="colocate",
        vllm_tensor_parallel_size=1,
        sync_ref_model=False,
        num_iterations=1,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        normalize_advantages=False,
    )
    base.update(overrides)
    return SimpleNamespace(**base)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"use_vllm": True, "vllm_tensor_parallel_size": 2}, "--vllm_tensor_parallel_size 1"),
        ({"sync_ref_model": True}, "--sync_ref_model false"),
        ({"steps_per_generation": 1}, "steps_per_generation=1 is below gradient_accumulation_steps=2"),
        ({"steps_per_generation": 5}, "steps_per_generation=5 is not a multiple of gradient_accumulation_steps=2"),
    ],
)
def test_refusals_name_the_fix(overrides, match):
    check_rloo_args(_args(), BALANCED)  # the defaults pass
    check_rloo_args(_args(normalize_advantages=True, use_vllm=True), BALANCED)  # exact: TRL's global batch
    check_rloo_args(_args(num_iterations=2, steps_per_generation=4), BALANCED)  # several updates per generation
    with pytest.raises(ValueError, match=match):
        check_rloo_args(_args(**overrides), BALANCED)


def test_vllm_server_mode_runs_under_odc():
    check_rloo_args(_args(use_vllm=True, vllm_mode="server"), BALANCED)


def test_plain_fsdp2_without_a_plan_keeps_trls_options():
    check_rloo_args(_args(num_iterations=2, steps_per_generation=1), ODCConfig(enable=False))
    check_rloo_args(_args(use_vllm=True, vllm_mode="server"), ODCConfig(enable=False))


def test_the_sequence_mean_weighs_by_rows():
    # 3 of 12 completions in this microbatch, 2 ranks: (1/3) sum over its rows -> (2/12) sum
    assert rloo_loss_weight(rows=3, total_rows=12, world_size=2) == pytest.approx(3 * 2 / 12)


def test_split_then_collate_carries_old_logps_and_advantages():
    pad = 7
    prompts, completions = [[11, 12, 13], [21]], [[101, 102], [201, 202, 203]]
    batch = {
        "prompt_ids": torch.tensor([[11, 12, 13], [pad, pad, 21]]),
        "prompt_mask": torch.tensor([[1, 1, 1], [0, 0, 1]]),
        "completion_ids": torch.tensor([[101, 102, pad], [201, 202, 203]]),
        "completion_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
        "old_logps": torch.tensor([-3.5, -7.25]),
        "advantages": torch.tensor([0.5, -0.5]),
    }
    rows = split_rollouts(batch, (), RLOO_KEYS)
    assert [r["prompt_ids"].tolist() for r in rows] == prompts
    assert [r["completion_ids"].tolist() for r in rows] == completions
    assert [float(r["old_logps"]) for r in rows] == [-3.5, -7.25]
    again = collate_rollouts(rows, pad, "cpu", (), RLOO_KEYS)
    for key, value in batch.items():
        assert torch.equal(again[key], value), key
    swapped = collate_rollouts(rows[::-1], pad, "cpu", (), RLOO_KEYS)
    assert swapped["old_logps"].tolist() == [-7.25, -3.5] and swapped["advantages"].tolist() == [-0.5, 0.5]
    with pytest.raises(ValueError, match="cannot carry"):
        split_rollouts({**batch, "pixel_values": torch.zeros(2, 3)}, (), RLOO_KEYS)


def test_finalize_gives_step_values_of_every_clip_gather():
    # two microbatches on this rank: entropy pairs, then the per-sequence clip indicators TRL gathers
    deferred = DeferredGather()
    for entropy, low, high in (((6.0, 3.0), [1.0, 0.0], [0.0, 0.0]), ((2.0, 1.0), [0.0], [1.0])):
        deferred.start_microbatch()
        deferred.reduce(torch.tensor(entropy))
        deferred(torch.tensor(low))
        deferred(torch.tensor(high))
        deferred(torch.maximum(torch.tensor(low), torch.tensor(high)))
    metrics = reduce_step_metrics(deferred, None, "cpu")
    trainer = SimpleNamespace(aux_loss_enabled=False, _metrics={"train": {}})
    recorded = trainer._metrics["train"]
    for name in (
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_mean",
        "clip_ratio/high_max",
    ):
        recorded[name] = [99.0, 99.0]  # TRL's per-microbatch values
    recorded["clip_ratio/region_mean"] = [99.0, 99.0]
    recorded["step_time"] = [1.0, 2.0]
    finalize_rloo_metrics(trainer, metrics)
    assert recorded["entropy"] == [pytest.approx(8.0 / 4.0)]
    assert recorded["clip_ratio/low_mean"] == [pytest.approx(1 / 3)]
    assert recorded["clip_ratio/low_min"] == [0.0]
    assert recorded["clip_ratio/high_mean"] == [pytest.approx(1 / 3)]
    assert recorded["clip_ratio/high_max"] == [1.0]
    assert recorded["clip_ratio/region_mean"] == [pytest.approx(2 / 3)]
    assert recorded["step_time"] == [3.0]
    assert len(trl_rloo.rloo_metric_calls(trainer)) == metrics.gathers_per_microbatch


def test_the_bootstrap_can_swap_the_rloo_names():
    assert {"RLOOConfig", "RLOOTrainer"} <= set(trl_classes.PUBLIC_CLASSES)


# ------------------------------------------------------------------------------ advantages: TRL's own code path
G = 4  # num_generations
REWARDS = torch.tensor(
    # 4 groups of 4; NaN: a completion no reward function scored. The second group spans the ranks of the 2-rank
    # split below (6 rows per rank), one group has a single scorable completion, one none.
    [1.0, 0.5, float("nan"), -1.0, 2.0, 2.5, 0.0, 1.0, float("nan"), 3.0, float("nan"), float("nan")]
    + [float("nan")] * 4
)
OLD = torch.linspace(-1.0, -4.0, 16 * 3).reshape(16, 3)  # per-token log-probs of the policy at generation
REF = OLD + torch.linspace(-0.3, 0.2, 16 * 3).reshape(16, 3)  # ... and of the reference model


class _FixedRLOO(RLOOTrainer):
    """TRL's RLOOTrainer with generation, rewards and log-probs fixed; nothing else of TRL's step is replaced."""

    def _generate(self, prompts):
        rows = self.rows
        return [[1, 2] for _ in rows], [[3, 4, 5] for _ in rows], ["abc" for _ in rows]

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        return REWARDS[:, None].clone()  # TRL returns every rank's rewards (gathered)

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        return (OLD if model is self.model else REF)[self.rows], None, None


def _trl_advantages(monkeypatch, beta: float, normalize: bool, rank: int, world: int) -> torch.Tensor:
    """This rank's advantages from TRL's ``_generate_and_score_completions`` on rank ``rank`` of ``world``."""
    from trl.trainer import rloo_trainer

    rows = torch.arange(16).reshape(world, -1)[rank]
    # TRL's gathers see every rank's values (here: the ranks' KL terms, computed from the fixed log-probs)
    kl_all = (OLD - REF).sum(-1)
    monkeypatch.setattr(rloo_trainer, "gather", lambda t: kl_all.clone() if t.shape == (len(rows),) else t)
    monkeypatch.setattr(rloo_trainer, "gather_object", lambda x: list(x))
    trainer = object.__new__(_FixedRLOO)
    model = SimpleNamespace(training=True, is_gradient_checkpointing=False)
    accelerator = SimpleNamespace(
        device=torch.device("cpu"),
        process_index=rank,
        reduce=lambda t, reduction="sum": t,
        gather=lambda t: t,
    )
    state = dict(
        rows=rows,
        model=model,
        ref_model=object(),
        accelerator=accelerator,
        args=SimpleNamespace(per_device_train_batch_size=len(rows), gradient_checkpointing_kwargs=None),
        beta=beta,
        normalize_advantages=normalize,
        num_generations=G,
        pad_to_multiple_of=None,
        mask_truncated_completions=False,
        eos_token_ids=[5],
        reward_weights=torch.ones(1),
        reward_clip_range=None,
        reward_func_names=["fixed"],
    )
    for key, value in state.items():
        setattr(trainer, key, value)
    trainer.__dict__.update(
        {
            "_tokenizer": SimpleNamespace(pad_token_id=0),
            "_metrics": {"train": defaultdict(list)},
            "_logs": {
                "prompt": [],
                "completion": [],
                "rewards": defaultdict(list),
                "advantages": [],
                "extra": defaultdict(list),
            },
            "_pending_extra_logs": {},
            "_pending_metrics": {},
        }
    )
    inputs = [{"prompt": "p"} for _ in rows]
    out = trl_grpo.generate_and_score_completions(trainer, inputs)
    assert torch.allclose(out["old_logps"], OLD[rows].sum(-1))
    return out["advantages"]


def _leave_one_out(beta: float, normalize: bool) -> torch.Tensor:
    """The advantages written from RLOO's definition: each scorable completion's reward (less beta x its summed KL)
    minus the mean of its group's other scorable completions; unscorable or alone: 0."""
    rewards = REWARDS - beta * (OLD - REF).sum(-1)
    out = torch.full((16,), float("nan"))
    for g in range(0, 16, G):
        for i in range(g, g + G):
            others = [rewards[j] for j in range(g, g + G) if j != i and not torch.isnan(rewards[j])]
            if not torch.isnan(rewards[i]) and others:
                out[i] = rewards[i] - sum(others) / len(others)
    if normalize:
        finite = out[~torch.isnan(out)]
        out = (out - finite.mean()) / (finite.std() + 1e-4)
    return torch.nan_to_num(out, nan=0.0)


@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("normalize", [False, True])
def test_advantages_are_trls_whichever_rank_holds_each_group(monkeypatch, beta, normalize):
    one = _trl_advantages(monkeypatch, beta, normalize, rank=0, world=1)
    assert torch.allclose(one, _leave_one_out(beta, normalize), atol=1e-6)
    # 2 ranks of 8 rows (whole groups) and 4 ranks of 4, and 8 ranks of 2: a group split over ranks
    for world in (2, 4, 8):
        split = torch.cat([_trl_advantages(monkeypatch, beta, normalize, r, world) for r in range(world)])
        assert torch.equal(split, one), world


# ------------------------------------------------- advantages and loss weights through ODC's split, plan and collation
# Distinct completions (identified by their first token, 100 + row) after prompts of 1-4 tokens, so that the plan
# regroups them; per-token log-probs whose sums overflow exp() (old_logps near -127), as long completions' do.
OLD_LONG = OLD - 40.0
REF_LONG = OLD_LONG + torch.linspace(-0.3, 0.2, 16 * 3).reshape(16, 3)


class _PlannedRLOO(ODCRLOOTrainer):
    """ODC's RLOO trainer with generation, rewards and log-probs fixed: TRL's generation batch, ODC's split, plan and
    collation, and TRL's loss (``_compute_loss``) on each planned microbatch are the trainers' own."""

    def _generate(self, prompts):
        rows = self.rows.tolist()
        return [[1] * (1 + r % 4) for r in rows], [[100 + r, 200 + r, 5] for r in rows], ["abc" for _ in rows]

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        return REWARDS[:, None].clone()  # TRL returns every rank's rewards (gathered)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *a, **kw):
        if not kw.get("compute_entropy"):  # at generation: the policy's and the reference's, fixed
            return (OLD_LONG if model is self.model else REF_LONG)[self.rows], None, None
        rows = input_ids[:, -logits_to_keep] - 100  # the loss: the trained log-probs of these completions
        return self.logps[rows], torch.zeros(len(rows), logits_to_keep), None


def _planned_trainer(rank: int, world: int, logps: torch.Tensor, config: ODCConfig, beta: float, normalize: bool):
    trainer = object.__new__(_PlannedRLOO)
    rows = torch.arange(16).reshape(world, -1)[rank]
    accelerator = SimpleNamespace(
        device=torch.device("cpu"),
        process_index=rank,
        num_processes=world,
        reduce=lambda t, reduction="sum": t,
        gather=lambda t: t,
        unwrap_model=lambda m: m,
        is_main_process=rank == 0,
    )
    args = SimpleNamespace(
        per_device_train_batch_size=len(rows),
        gradient_checkpointing_kwargs=None,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
    )
    trainer.__dict__.update(
        rows=rows,
        logps=logps,
        model=SimpleNamespace(training=True, is_gradient_checkpointing=False),
        ref_model=object(),
        accelerator=accelerator,
        args=args,
        beta=beta,
        normalize_advantages=normalize,
        num_generations=G,
        pad_to_multiple_of=None,
        mask_truncated_completions=False,
        eos_token_ids=[5],
        reward_weights=torch.ones(1),
        reward_clip_range=None,
        reward_func_names=["fixed"],
        epsilon_low=0.2,
        epsilon_high=0.2,
        aux_loss_enabled=False,
        max_completion_length=3,
        odc_config=config,
        odc_run=SimpleNamespace(folded_accumulation=1),
        odc_step_timer=SimpleNamespace(add_work=lambda *a: None),
        _odc_looping=False,
        _odc_totals=(0, 0.0),
        _tokenizer=SimpleNamespace(pad_token_id=0),
        _metrics={"train": defaultdict(list)},
        _logs={
            "prompt": [],
            "completion": [],
            "rewards": defaultdict(list),
            "advantages": [],
            "extra": defaultdict(list),
        },
        _pending_extra_logs={},
        _pending_metrics={},
    )
    return trainer


def _trl_one_process(monkeypatch, beta, normalize):
    """TRL's RLOO on one process, the 16 completions in one microbatch: each completion's advantage, and the gradient
    of its loss with respect to the trained per-token log-probs (its weight x advantage)."""
    from trl.trainer import rloo_trainer

    monkeypatch.setattr(rloo_trainer, "gather", lambda t: t)
    monkeypatch.setattr(rloo_trainer, "gather_object", lambda x: list(x))
    logps = OLD_LONG.clone().requires_grad_(True)  # the policy as at generation: every ratio is 1
    trainer = _planned_trainer(0, 1, logps, ODCConfig(enable=False), beta, normalize)
    batch = trl_grpo.generate_and_score_completions(trainer, [{"prompt": "p"}] * 16)
    RLOOTrainer.compute_loss(trainer, trainer.model, batch).backward()
    return batch["advantages"], logps.grad


def _with_an_empty_slot(monkeypatch):
    """The lockstep plan with rank 0's last slot emptied (its samples moved into its previous microbatch): what the
    plan gives a rank when a step has fewer microbatches than slots (16 completions on 2 ranks rarely do)."""
    from odc_accelerate.planning import StreamingStepPlanner

    plan = StreamingStepPlanner.plan

    def emptied(self, lengths):
        out = plan(self, lengths)
        out[0][-2] = out[0][-2] + out[0][-1]
        out[0][-1] = []
        return out

    monkeypatch.setattr(StreamingStepPlanner, "plan", emptied)


def _odc_two_ranks(monkeypatch, beta, normalize, config):
    """What each of 2 ranks computes under ODC: TRL's generation batch on the rank (its advantages over the gathered
    rewards), ODC's split, the gathered rows, the plan and this rank's collated microbatches, and the weighted loss of
    each; the backward of their sum over ranks / 2 (FSDP2's average). Returns per completion (by its row) the advantage
    it was trained with and how many times it was trained, the gradient, and the ranks' microbatches."""
    import accelerate.utils
    from trl.trainer import rloo_trainer

    from odc_accelerate.integrations.trl.online import ODCOnlineTrainerMixin

    kl_all = (OLD_LONG - REF_LONG).sum(-1)
    monkeypatch.setattr(rloo_trainer, "gather", lambda t: kl_all.clone() if t.shape == (8,) else t)
    monkeypatch.setattr(rloo_trainer, "gather_object", lambda x: list(x))
    logps = OLD_LONG.clone().requires_grad_(True)
    trainers = [_planned_trainer(rank, 2, logps, config, beta, normalize) for rank in (0, 1)]
    batches = [t._odc_generate([{"prompt": "p"}] * 8) for t in trainers]
    split = [split_rollouts(b, (), RLOO_KEYS) for b in batches]
    # accelerate's gather_object, as the ranks see it: every rank's rows, rank 0's first
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda rows: [split[0], split[1]])
    advantages, seen, total, planned = {}, torch.zeros(16, dtype=torch.long), 0.0, []
    for trainer, batch in zip(trainers, batches, strict=True):
        (step,) = ODCOnlineTrainerMixin._odc_gather_generation(trainer, batch)  # one step per generation batch
        microbatches = ODCOnlineTrainerMixin._odc_plan(trainer, step)
        planned.append(microbatches)
        trainer._odc_looping = True
        for mb in microbatches:
            zero = isinstance(mb, ZeroWeightMicrobatch)
            inputs = mb.batch if zero else mb
            loss = trainer.compute_loss(trainer.model, inputs, num_items_in_batch=batch.get("num_items_in_batch"))
            total = total + (loss * 0.0 if zero else loss) / 2  # the step loop's zero-weight backward; FSDP2's mean
            if not zero and int(inputs["odc_rows"]) > 0:
                for row, adv in zip(_rows(inputs), inputs["advantages"], strict=True):
                    advantages[row] = adv
                    seen[row] += 1
    total.backward()
    return advantages, seen, logps.grad, planned


@pytest.mark.parametrize(
    ("config", "empty_slot"),
    [
        (ODCConfig(enable=False, plan="lockstep", max_tokens_per_microbatch=12), True),  # plain FSDP2, a filler
        (ODCConfig(enable=True, plan="free", max_tokens_per_microbatch=12), False),
    ],
)
@pytest.mark.parametrize(("beta", "normalize"), [(0.05, False), (0.0, True)])
def test_advantages_and_loss_weights_through_odcs_plan_on_two_ranks_are_trls_on_one(
    monkeypatch, config, empty_slot, beta, normalize
):
    expected_advantages, expected_grad = _trl_one_process(monkeypatch, beta, normalize)
    assert expected_advantages.abs().sum() > 0 and torch.isfinite(expected_grad).all()
    if empty_slot:
        _with_an_empty_slot(monkeypatch)
    advantages, seen, grad, planned = _odc_two_ranks(monkeypatch, beta, normalize, config)
    # weight x advantage per completion token: the step's gradient is TRL's one-process gradient, finite
    assert torch.isfinite(grad).all()
    assert torch.allclose(grad, expected_grad, rtol=1e-6, atol=0.0), (grad - expected_grad).abs().max()
    assert seen.tolist() == [1] * 16  # every completion trained once, on one rank
    for row in range(16):
        assert torch.equal(advantages[row], expected_advantages[row]), row
    sizes = [[len(_rows(mb)) for mb in p] for p in planned]
    assert sorted(n for p in sizes for n in p) != [8, 8], sizes  # the plan regrouped the step's completions
    fillers = [mb for p in planned for mb in p if isinstance(mb, ZeroWeightMicrobatch)]
    assert len(fillers) == int(empty_slot) and (not empty_slot or isinstance(planned[0][-1], ZeroWeightMicrobatch))


def _rows(mb) -> list[int]:
    return ((mb.batch if isinstance(mb, ZeroWeightMicrobatch) else mb)["completion_ids"][:, 0] - 100).tolist()


def test_an_empty_lockstep_slot_gives_a_finite_loss_and_exact_zero_gradients(monkeypatch):
    """The filler of an empty slot alone: its loss through TRL's ``_compute_loss`` and ODC's weight is finite, and its
    zero-weight backward adds exact zeros (a masked-out filler with old_logps near -127 gave NaN)."""
    config = ODCConfig(enable=False, plan="lockstep", max_tokens_per_microbatch=12)
    _with_an_empty_slot(monkeypatch)
    *_, planned = _odc_two_ranks(monkeypatch, 0.05, False, config)
    assert planned[0][-1].batch["completion_mask"].sum() > 0  # a real completion: one of the rank's own
    assert _rows(planned[0][-1]) == _rows(planned[0][-2])[-1:]

    fillers = [(rank, mb) for rank, p in enumerate(planned) for mb in p if isinstance(mb, ZeroWeightMicrobatch)]
    assert len(fillers) == 1
    rank, filler = fillers[0]
    logps = OLD_LONG.clone().requires_grad_(True)
    trainer = _planned_trainer(rank, 2, logps, config, 0.05, False)
    trainer._odc_looping, trainer._odc_totals = True, (16, 0.0)
    raw = RLOOTrainer.compute_loss(trainer, trainer.model, filler.batch)
    assert torch.isfinite(raw)
    loss = trainer.compute_loss(trainer.model, filler.batch)
    (loss * 0.0).backward()
    assert torch.equal(logps.grad, torch.zeros_like(logps))
