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
from odc_accelerate.integrations.trainer.metrics import DeferredGather, reduce_step_metrics
from odc_accelerate.integrations.trl.loss import rloo_loss_weight
from odc_accelerate.integrations.trl.metrics import finalize_rloo_metrics
from odc_accelerate.integrations.trl.rloo import RLOO_KEYS, check_rloo_args
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
        ({"use_vllm": True, "vllm_mode": "server"}, "Use --vllm_mode colocate"),
        ({"use_vllm": True, "vllm_tensor_parallel_size": 2}, "--vllm_tensor_parallel_size 1"),
        ({"sync_ref_model": True}, "--sync_ref_model false"),
        ({"num_iterations": 2}, "--num_iterations 1"),
        ({"steps_per_generation": 4}, "Leave --steps_per_generation unset"),
    ],
)
def test_refusals_name_the_fix(overrides, match):
    check_rloo_args(_args(), BALANCED)  # the defaults pass
    check_rloo_args(_args(normalize_advantages=True, use_vllm=True), BALANCED)  # exact: TRL's global batch
    with pytest.raises(ValueError, match=match):
        check_rloo_args(_args(**overrides), BALANCED)


def test_plain_fsdp2_without_a_plan_keeps_trls_options():
    check_rloo_args(_args(num_iterations=2, steps_per_generation=4), ODCConfig(enable=False))
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
