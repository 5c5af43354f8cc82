"""The reward-model trainer's pieces without a launch: pair lengths and the token budget, the loss weight, the step's
metrics from the deferred gathers (a rank with no pair included); and the refusal of online DPO by name."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from odc_accelerate._compat.trl import reward as reward_compat
from odc_accelerate.integrations.trainer.budget import token_budget
from odc_accelerate.integrations.trainer.metrics import DeferredGather, reduce_step_metrics
from odc_accelerate.integrations.trl.pairs import (
    ODCPairTrainerMixin,
    pair_budget_tokens,
    pair_lengths,
    pair_loss_weight,
)
from odc_accelerate.integrations.trl.reward import REWARD_ODC_GATHERS, ODCRewardTrainer, finalize_reward_metrics
from odc_accelerate.integrations.trl.unsupported import PLAIN_FSDP2, unsupported_trainer_message


# ------------------------------------------------------------------------------------------------- lengths and budget
def _stub(max_length, trainer=ODCRewardTrainer):
    """What a pair trainer's planning methods read of the trainer: its arguments, its own methods and names."""
    stub = SimpleNamespace(args=SimpleNamespace(max_length=max_length))
    stub._odc_budget_tokens = lambda lengths: trainer._odc_budget_tokens(stub, lengths)
    stub.odc_pair_sample, stub.odc_pair_remedy = trainer.odc_pair_sample, trainer.odc_pair_remedy
    stub.odc_packs_pairs = trainer.odc_packs_pairs
    return stub


def test_pair_lengths_are_chosen_and_rejected_and_the_budget_counts_both_padded_to_the_longer():
    from datasets import Dataset

    # TRL's processed reward data: the prompt is already in both sequences
    data = Dataset.from_dict({"chosen_ids": [[1] * 5, [1] * 2, [1] * 9], "rejected_ids": [[2] * 3, [2] * 7, [2] * 9]})
    lengths = ODCRewardTrainer._odc_lengths(_stub(16), data)
    assert lengths.tolist() == [[5, 3], [2, 7], [9, 9]]
    assert pair_lengths([5, 2], [3, 7]).tolist() == [[5, 3], [2, 7]]
    # a pair alone is a [2, longer] batch
    assert pair_budget_tokens(lengths).tolist() == [10, 14, 18]
    assert ODCRewardTrainer._odc_budget_tokens(_stub(16), lengths).tolist() == [10, 14, 18]


def test_default_budget_is_one_longest_pair_and_an_oversize_pair_stops_the_run():
    lengths = np.array([[5, 3], [2, 7], [9, 9]])
    rule = ODCRewardTrainer._odc_budget_rule(_stub(16), lengths)
    assert (rule.default, rule.oversize) == (32, "raise")  # 2 x max_length
    assert token_budget(pair_budget_tokens(lengths), None, rule) == 32
    with pytest.raises(ValueError, match=r"smaller than the longest pair \(chosen and rejected, both padded to the "):
        token_budget(pair_budget_tokens(lengths), 16, rule)
    # without max_length: the longest pair
    assert ODCRewardTrainer._odc_budget_rule(_stub(None), lengths).default == 18


def test_dpo_and_the_reward_trainer_share_the_pair_hooks_and_name_their_own_pair():
    from odc_accelerate.integrations.trl.dpo import ODCDPOTrainer

    lengths = np.array([[5, 3], [2, 7], [9, 9]])
    for trainer in (ODCDPOTrainer, ODCRewardTrainer):
        for hook in ("_odc_budget_tokens", "_odc_budget_rule", "_odc_num_items", "_odc_queue_items"):
            assert getattr(trainer, hook) is getattr(ODCPairTrainerMixin, hook), (trainer, hook)
    dpo, reward = (t._odc_budget_rule(_stub(16, t), lengths) for t in (ODCDPOTrainer, ODCRewardTrainer))
    assert (dpo.default, reward.default) == (32, 32)
    assert dpo.sample.startswith("pair (prompt + chosen") and reward.sample.startswith("pair (chosen and rejected")
    assert "longer pairs are dropped" in reward.remedy and "dropped" not in dpo.remedy
    # DPO's padding_free: a pair packed into one row holds its two lengths, not twice the longer
    assert pair_budget_tokens(lengths).tolist() == [10, 14, 18]
    assert pair_budget_tokens(lengths, packed=True).tolist() == [8, 9, 18]


def test_a_step_counts_pairs():
    microbatches = [{"input_ids": torch.zeros(4, 7)}, {"input_ids": torch.zeros(2, 3)}]  # [chosen; rejected] rows
    assert ODCRewardTrainer._odc_num_items(None, microbatches) == 3
    queue = SimpleNamespace(queue=SimpleNamespace(microbatches=[[0, 4], [7], [2, 3, 5]]))
    assert ODCRewardTrainer._odc_queue_items(None, queue) == 6


def test_the_loss_weight_makes_the_mean_over_every_pair_of_the_step():
    # rank 0: microbatches of 2 and 1 pairs; rank 1: 3 pairs; FSDP2 averages the two ranks' gradients
    per_pair = {0: [[0.5, 1.5], [3.0]], 1: [[1.0, 2.0, 4.0]]}
    total, world = 6, 2
    step = 0.0
    for microbatches in per_pair.values():
        for losses in microbatches:
            step += np.mean(losses) * pair_loss_weight(len(losses), total, world) / world
    assert step == pytest.approx(np.mean([0.5, 1.5, 3.0, 1.0, 2.0, 4.0]))


# ---------------------------------------------------------------------------------------------------------- metrics
def _gathers(deferred, chosen, rejected, tokens):
    """A microbatch's gathers as `ODCRewardTrainer.compute_loss` makes them: TRL's four, then the trainer's two."""
    deferred.start_microbatch()
    deferred(torch.tensor(tokens))  # attention_mask.sum()
    deferred(torch.cat([chosen, rejected])[:, None])  # outputs.logits
    deferred((chosen > rejected).float().mean())
    deferred((chosen - rejected).mean())
    deferred((chosen > rejected).float())
    deferred(chosen - rejected)


class _StandIn:
    """What the metrics read of TRL's RewardTrainer: its recorded metrics and running token count."""

    def __init__(self, recorded, tokens=100):
        self._metrics = {"train": recorded}
        self._total_train_tokens = tokens  # TRL's running count: earlier steps, and this step's own gathers


@pytest.mark.parametrize("idle_rank", [False, True])
def test_step_metrics_are_trls_over_the_whole_step(idle_rank):
    """Two ranks' microbatches (rank 1 with none when ``idle_rank``), combined as the step boundary does, against
    TRL's values for the whole global batch as one microbatch."""
    g = torch.Generator().manual_seed(0)
    pairs = [[3, 1], [] if idle_rank else [2]]  # pairs per microbatch, per rank
    tokens = {3: 40, 1: 11, 2: 25}
    ranks = []
    for sizes in pairs:
        ranks.append([(torch.randn(n, generator=g), torch.randn(n, generator=g), tokens[n]) for n in sizes])
    rows, deferreds = [], []
    for microbatches in ranks:
        deferred = DeferredGather()
        for chosen, rejected, count in microbatches:
            _gathers(deferred, chosen, rejected, count)
        captured = []
        reduce_step_metrics(deferred, lambda t, c=captured: c.append(t) or t, "cpu")
        rows.append(captured[0])
        deferreds.append(deferred)
    everyone = torch.cat(rows)
    chosen = torch.cat([c for r in ranks for c, _, _ in r])
    rejected = torch.cat([x for r in ranks for _, x, _ in r])
    rewards = torch.cat([chosen, rejected])
    for rank, microbatches in enumerate(ranks):
        metrics = reduce_step_metrics(deferreds[rank], lambda t: everyone, "cpu")
        assert metrics.gathers_per_microbatch == len(reward_compat.REWARD_TRAIN_GATHERS) + len(REWARD_ODC_GATHERS)
        # TRL appended one value per microbatch of this rank (99: an earlier step's)
        recorded = {name: [99.0] + [1.0] * len(microbatches) for name in reward_compat.REWARD_PER_MICROBATCH}
        # TRL's running count saw only this rank's tokens (100: earlier steps)
        finalize_reward_metrics(_StandIn(recorded, 100 + sum(count for _, _, count in microbatches)), metrics)
        expected = {
            "min_reward": rewards.min(),
            "mean_reward": rewards.mean(),
            "max_reward": rewards.max(),
            "accuracy": (chosen > rejected).float().mean(),
            "margin": (chosen - rejected).mean(),
        }
        for name, value in expected.items():
            assert recorded[name][0] == 99.0 and len(recorded[name]) == 2, name
            assert recorded[name][1] == pytest.approx(float(value), rel=1e-6), name
        assert recorded["num_tokens"] == [100 + sum(tokens[n] for sizes in pairs for n in sizes)]


def test_step_accuracy_is_weighted_by_pairs_not_by_rank():
    """TRL's accuracy is a mean of rank means; with unequal pairs per rank the step's value is the mean over pairs."""
    deferreds = [DeferredGather(), DeferredGather()]
    _gathers(deferreds[0], torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0.0, 0.0, 0.0]), 30)  # 3 right
    _gathers(deferreds[1], torch.tensor([0.0]), torch.tensor([1.0]), 10)  # 1 wrong
    rows = []
    for deferred in deferreds:
        reduce_step_metrics(deferred, lambda t, r=rows: r.append(t) or t, "cpu")
    metrics = reduce_step_metrics(deferreds[0], lambda t: torch.cat(rows), "cpu")
    recorded = {name: [0.0] for name in reward_compat.REWARD_PER_MICROBATCH}
    finalize_reward_metrics(_StandIn(recorded), metrics)
    assert recorded["accuracy"] == [0.75]  # not (1 + 0) / 2


# ---------------------------------------------------------------------------------------------------------- refusals
def test_online_dpo_is_refused_by_name_with_the_reason():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's experimental-API warning
        from trl.experimental.online_dpo import OnlineDPOTrainer

    online = unsupported_trainer_message(object.__new__(OnlineDPOTrainer))
    assert online.startswith("ODC does not support TRL's OnlineDPOTrainer: it generates completions")
    assert "gather_object of the prompts" in online
    assert "train it with plain FSDP2 (`odc: false`)" in online and online.endswith(PLAIN_FSDP2 + ".")

    class MyOnlineDPO(OnlineDPOTrainer):  # built on TRL's OnlineDPOTrainer: refused, naming both
        pass

    mine = unsupported_trainer_message(MyOnlineDPO)
    assert (
        f"{__name__}.test_online_dpo_is_refused_by_name_with_the_reason.<locals>.MyOnlineDPO (built on TRL's "
        "OnlineDPOTrainer)" in mine
    )


def test_supported_and_foreign_trainers_are_not_refused_by_name():
    from transformers import Trainer
    from trl import DistillationTrainer, DPOTrainer, KTOTrainer, RewardTrainer

    for cls in (RewardTrainer, DPOTrainer, KTOTrainer, DistillationTrainer, Trainer, ODCRewardTrainer):
        assert unsupported_trainer_message(cls) is None, cls

    class OnlineDPOTrainer:  # the name alone, outside TRL
        pass

    assert unsupported_trainer_message(OnlineDPOTrainer) is None
