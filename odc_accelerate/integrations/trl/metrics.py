"""The TRL trainers' metrics of one ODC step: from the per-microbatch values recorded locally to one global value.

During a step's microbatches the trainers' metric gathers are answered with this rank's values
(`~odc_accelerate.integrations.trainer.metrics.DeferredGather`); at the step boundary one reduction gives the sums of
every rank (`~odc_accelerate.integrations.trainer.metrics.StepMetrics`), and the functions below replace what TRL
recorded for each microbatch with the value one process logs when the global batch is one microbatch. What each
gather means, in TRL's call order, is pinned in `odc_accelerate._compat.trl` (its `sft`, `dpo`, `grpo`, `reward` and
`rloo` modules).
"""

from __future__ import annotations

from typing import Any

from ..._compat import trl as trl_compat
from ..._compat.trl import dpo as trl_dpo
from ..._compat.trl import grpo as trl_grpo
from ..._compat.trl import reward as reward_compat
from ..._compat.trl import rloo as trl_rloo
from ..._compat.trl import sft as trl_sft
from ..trainer.metrics import StepMetrics

__all__ = [
    "REWARD_ODC_GATHERS",
    "finalize_dpo_metrics",
    "finalize_grpo_metrics",
    "finalize_reward_metrics",
    "finalize_rloo_metrics",
    "finalize_sft_metrics",
]

#: The gathers `ODCRewardTrainer` adds after TRL's own in each microbatch (answered locally, never a collective): each
#: pair's accuracy (chosen scored above rejected) and margin (chosen minus rejected), so that the step's values are
#: means over its pairs.
REWARD_ODC_GATHERS = ("correct_pairs", "pair_margins")


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def _drop_microbatch_values(recorded: dict[str, list], keys: Any, microbatches: int) -> None:
    for key in keys:
        if microbatches and key in recorded:
            del recorded[key][-microbatches:]


def finalize_sft_metrics(trainer: Any, metrics: StepMetrics) -> None:
    """SFT: ``entropy`` and ``mean_token_accuracy`` become token-weighted values over every label token of the step on
    every rank; ``num_tokens`` counts the input tokens of all ranks."""
    names = trl_sft.SFT_TRAIN_GATHERS
    total = dict(zip(names, metrics.global_sums, strict=False))
    mine = dict(zip(names, metrics.local_sums, strict=False))
    recorded = trl_compat.train_metrics(trainer)
    _drop_microbatch_values(recorded, ("entropy", "mean_token_accuracy"), metrics.local_microbatches)
    recorded["entropy"].append(_ratio(total["entropy_sum"], total["num_valid"]))
    recorded["mean_token_accuracy"].append(_ratio(total["num_correct"], total["num_valid"]))
    trl_compat.count_train_tokens(trainer, total["num_tokens"], mine["num_tokens"])
    if getattr(trainer, "aux_loss_enabled", False) and len(metrics.global_sums) > len(names):
        # Each microbatch's value was weighted by its share of the step's routed tokens: the step's is their sum.
        _drop_microbatch_values(recorded, ("aux_loss",), metrics.local_microbatches)
        recorded["aux_loss"].append(float(metrics.global_sums[len(names)]))


def finalize_dpo_metrics(trainer: Any, metrics: StepMetrics) -> None:
    """DPO: token-weighted metrics (entropy, logits, token accuracy) are ratios of global sums; reward and log-prob
    metrics are means over every pair of the step on every rank; ``num_tokens`` counts the input tokens of all
    ranks."""
    names = trl_dpo.dpo_gathers(trainer)
    total = dict(zip(names, metrics.global_sums, strict=False))
    count = dict(zip(names, metrics.global_counts, strict=False))
    mine = dict(zip(names, metrics.local_sums, strict=False))
    recorded = trl_compat.train_metrics(trainer)
    _drop_microbatch_values(recorded, trl_dpo.DPO_PER_MICROBATCH, metrics.local_microbatches)
    values = {
        "entropy": _ratio(total["entropy_sum"], total["entropy_tokens"]),
        "logits/chosen": _ratio(total["chosen_logits_sum"], total["chosen_tokens"]),
        "logits/rejected": _ratio(total["rejected_logits_sum"], total["rejected_tokens"]),
        "mean_token_accuracy": _ratio(total["correct_tokens"], total["accuracy_tokens"]),
    }
    per_pair = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"]
    per_pair += ["logps/chosen", "logps/rejected"]
    for key in per_pair:
        values[key] = _ratio(total[key], count[key])
    if "aux_loss" in names:  # weighted by each microbatch's share of the step's routed tokens: their sum
        values["aux_loss"] = total["aux_loss"]
    for key, value in values.items():
        recorded[key].append(value)
    trl_compat.count_train_tokens(trainer, total["num_tokens"], mine["num_tokens"])


def finalize_reward_metrics(trainer: Any, metrics: StepMetrics) -> None:
    """Reward model: ``min_reward`` / ``mean_reward`` / ``max_reward`` over every reward (chosen and rejected) of the
    step on every rank, ``accuracy`` and ``margin`` means over every pair of the step, ``num_tokens`` counting the
    input tokens of all ranks: the values TRL logs when the global batch is one microbatch."""
    names = reward_compat.REWARD_TRAIN_GATHERS + REWARD_ODC_GATHERS
    total = dict(zip(names, metrics.global_sums, strict=False))
    count = dict(zip(names, metrics.global_counts, strict=False))
    mine = dict(zip(names, metrics.local_sums, strict=False))
    index = {name: i for i, name in enumerate(names)}
    recorded = trl_compat.train_metrics(trainer)
    _drop_microbatch_values(recorded, reward_compat.REWARD_PER_MICROBATCH, metrics.local_microbatches)
    values = {
        "min_reward": metrics.global_mins[index["rewards"]],
        "mean_reward": _ratio(total["rewards"], count["rewards"]),
        "max_reward": metrics.global_maxs[index["rewards"]],
        "accuracy": _ratio(total["correct_pairs"], count["correct_pairs"]),
        "margin": _ratio(total["pair_margins"], count["pair_margins"]),
    }
    for key, value in values.items():
        recorded[key].append(float(value))
    trl_compat.count_train_tokens(trainer, total["num_tokens"], mine["num_tokens"])


def _step_value(metrics: StepMetrics, i: int, how: str) -> float:
    """The step's value of the ``i``-th gather of a microbatch: a ratio of summed values, a minimum or a maximum."""
    if how == "ratio":
        return metrics.global_sums[i] / max(metrics.global_counts[i], 1.0)
    return metrics.global_mins[i] if how == "min" else metrics.global_maxs[i]


def _one_step_time(recorded: dict[str, list], microbatches: int) -> None:
    """TRL's per-microbatch ``step_time`` becomes the step's (their sum)."""
    times = recorded.get("step_time")
    if microbatches and times is not None and len(times) >= microbatches:
        step_time = sum(times[-microbatches:])
        del times[-microbatches:]
        times.append(step_time)


def finalize_grpo_metrics(trainer: Any, metrics: StepMetrics) -> None:
    """GRPO: each loss metric (kl, entropy, clip ratios, ...) becomes one global value (a ratio of summed pairs, a
    minimum or a maximum over every rank); TRL's per-microbatch ``step_time`` becomes the step's."""
    recorded = trl_compat.train_metrics(trainer)
    mbs = metrics.local_microbatches
    for i, (name, how) in enumerate(trl_grpo.grpo_metric_calls(trainer)):
        _drop_microbatch_values(recorded, (name,), mbs)
        recorded[name].append(float(_step_value(metrics, i, how)))
    _one_step_time(recorded, mbs)


def finalize_rloo_metrics(trainer: Any, metrics: StepMetrics) -> None:
    """RLOO: the entropy becomes a ratio of global sums over every completion token of the step; each clip ratio a mean
    (or minimum / maximum) over every completion of the step on every rank; TRL's per-microbatch ``step_time``
    becomes the step's."""
    recorded = trl_compat.train_metrics(trainer)
    mbs = metrics.local_microbatches
    for i, call in enumerate(trl_rloo.rloo_metric_calls(trainer)):
        for name, how in call:
            _drop_microbatch_values(recorded, (name,), mbs)
            recorded[name].append(float(_step_value(metrics, i, how)))
    _one_step_time(recorded, mbs)
