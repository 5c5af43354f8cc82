"""Several optimizer steps per generation batch under a balanced plan (GRPO, RLOO), one process: which completions
each step trains, how often the sampler repeats a generation batch's prompts, when TRL's old log-probs are computed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer

from odc_accelerate._compat.trl import grpo as trl_grpo
from odc_accelerate.integrations.trl.online import ODCOnlineTrainerMixin
from odc_accelerate.integrations.trl.online_checks import generation_slices, optimizer_steps_per_generation
from odc_accelerate.integrations.trl.rollouts import step_slices


def test_each_step_takes_its_part_of_every_ranks_rows():
    per_rank = [[f"a{i}" for i in range(6)], [f"b{i}" for i in range(6)]]
    assert step_slices(per_rank, 3) == [["a0", "a1", "b0", "b1"], ["a2", "a3", "b2", "b3"], ["a4", "a5", "b4", "b5"]]
    assert step_slices(per_rank, 1) == [per_rank[0] + per_rank[1]]
    with pytest.raises(ValueError, match="does not split into 4 optimizer steps"):
        step_slices(per_rank, 4)


@pytest.mark.parametrize(
    ("spg", "ga", "iterations", "slices", "steps"),
    [(None, 2, 1, 1, 1), (2, 2, 1, 1, 1), (2, 2, 3, 1, 3), (4, 2, 1, 2, 2), (4, 1, 2, 4, 8)],
)
def test_steps_per_generation_batch(spg, ga, iterations, slices, steps):
    args = SimpleNamespace(steps_per_generation=spg, num_iterations=iterations)
    assert generation_slices(args, ga) == slices
    assert optimizer_steps_per_generation(args, ga) == steps


class _Sampling(ODCOnlineTrainerMixin, GRPOTrainer):
    """GRPOTrainer's prompt sampler, with ODC's `_get_train_sampler` over it."""


def _loader_items(balanced: bool, spg: int, ga: int, iterations: int, bs: int = 2) -> list[list[int]]:
    """The prompt indices of each item of the training loader (one process: ``bs x spg`` per item)."""
    trainer = object.__new__(_Sampling)
    trainer.__dict__.update(
        train_dataset=range(24),
        num_generations=2,
        num_iterations=iterations,
        shuffle_dataset=True,
        args=SimpleNamespace(
            generation_batch_size=bs * spg, steps_per_generation=spg, num_iterations=iterations, seed=0
        ),
        odc_config=SimpleNamespace(balanced=balanced),
        odc_run=SimpleNamespace(folded_accumulation=ga),
    )
    sampler = trainer._get_train_sampler()
    indices = list(sampler)
    assert len(indices) == len(sampler)
    return [indices[i : i + bs * spg] for i in range(0, len(indices), bs * spg)]


@pytest.mark.parametrize(("spg", "ga", "iterations"), [(2, 2, 1), (2, 2, 3), (4, 2, 1), (4, 1, 2), (6, 3, 2)])
def test_the_sampler_gives_each_step_the_prompts_trl_gives_it(spg, ga, iterations):
    """TRL's loader yields a generation batch once per accumulation step (ga per optimizer step); ODC's yields one item
    per optimizer step: the item of each ODC step is the first item of the same TRL step, and an epoch has as many
    optimizer steps."""
    trl = _loader_items(False, spg, ga, iterations)
    assert _loader_items(True, spg, ga, iterations) == trl[::ga]
    assert len(trl) % ga == 0


class _Trainer(ODCOnlineTrainerMixin):
    """The step logic of `ODCOnlineTrainerMixin` on recorded stand-ins for generation and planning."""

    def __init__(self, spg: int, ga: int, iterations: int, local_rows: int = 4) -> None:
        self.args = SimpleNamespace(steps_per_generation=spg, num_iterations=iterations, gradient_accumulation_steps=1)
        self.odc_run = SimpleNamespace(folded_accumulation=ga)
        self.accelerator = SimpleNamespace(num_processes=1, device=torch.device("cpu"))
        self.local_rows = local_rows
        self._odc_generation, self._odc_generation_items, self._odc_generation_step = None, None, 0
        self.generations: list[int] = []

    def _odc_generate(self, inputs):
        self.generations.append(inputs)
        rows = self.local_rows
        return {
            "prompt_ids": torch.ones(rows, 2, dtype=torch.long),
            "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
            "completion_ids": torch.full((rows, 3), inputs * 100) + torch.arange(rows)[:, None],
            "completion_mask": torch.ones(rows, 3, dtype=torch.long),
            "advantages": torch.zeros(rows),
            "num_items_in_batch": torch.tensor(3 * rows),
        }

    def _odc_plan(self, rows):
        return [int(r["completion_ids"][0]) for r in rows]


def test_a_generation_batch_feeds_each_slice_once_per_iteration(monkeypatch):
    monkeypatch.setattr(trl_grpo, "shuffle_generation_batch", lambda batch, module: batch)  # keep the order
    trainer = _Trainer(spg=4, ga=2, iterations=2)
    # loader items 0, 1, ... (one per optimizer step); a generation batch feeds 2 slices x 2 iterations = 4 steps
    steps = [trainer._odc_step_microbatches(item) for item in range(8)]
    assert trainer.generations == [0, 4]
    assert steps == [[0, 1], [2, 3], [0, 1], [2, 3], [400, 401], [402, 403], [400, 401], [402, 403]]
    assert float(trainer._odc_generation_items) == 12.0  # the generation batch's loss tokens: TRL's num_items


def test_the_generation_batch_is_shuffled_as_trl_shuffles_it_before_slicing(monkeypatch):
    seen = []

    def reverse(batch):
        seen.append(len(batch["advantages"]))
        return {k: v.flip(0) if v.ndim else v for k, v in batch.items()}

    from trl.trainer import grpo_trainer

    monkeypatch.setattr(grpo_trainer, "shuffle_sequence_dict", reverse)
    trainer = _Trainer(spg=2, ga=1, iterations=1)
    assert [trainer._odc_step_microbatches(item) for item in range(2)] == [[3, 2], [1, 0]]
    assert seen == [4]
    # one slice per generation batch: the step trains all of it, in any order (no shuffle)
    trainer = _Trainer(spg=2, ga=2, iterations=3)
    assert [trainer._odc_step_microbatches(item) for item in range(3)] == [[0, 1, 2, 3]] * 3
    assert seen == [4]


@pytest.mark.parametrize(("spg", "ga", "iterations", "old"), [(2, 2, 1, False), (2, 2, 2, True), (4, 2, 1, True)])
def test_trl_decides_on_the_old_log_probs_with_its_own_accumulation(monkeypatch, spg, ga, iterations, old):
    """TRL computes old_per_token_logps when ga % (steps_per_generation x num_iterations) != 0: under a plan it sees the
    accumulation the trainer folded, and the folded value is back after."""
    seen = []

    def score(trainer, inputs):
        a = trainer.args
        seen.append(a.gradient_accumulation_steps % (a.steps_per_generation * a.num_iterations) != 0)
        return {}

    monkeypatch.setattr(trl_grpo, "generate_and_score_completions", score)
    trainer = _Trainer(spg=spg, ga=ga, iterations=iterations)
    ODCOnlineTrainerMixin._odc_generate(trainer, [])
    assert seen == [old]
    assert trainer.args.gradient_accumulation_steps == 1
