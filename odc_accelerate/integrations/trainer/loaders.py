"""The balanced step loader of the ODC Trainer (map-style datasets): one dataloader item is this rank's whole step.

A `LengthBalancedBatchSampler` plans every step over all ranks (``samples_per_step`` samples) under the token budget
per microbatch (`budget.token_budget`), and each rank gets its own list of microbatches, so ranks may run different
numbers of microbatches. With a padded collator the plan is made on padded shapes. accelerate's re-sharding of the
loader is bypassed: the sampler is already rank-aware.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from ..._compat import transformers as tcompat
from .budget import BudgetRule, token_budget
from .data import PaddedRows, SequenceBoundaries, StepCollator, StepDataLoader, StepDataset
from .dynamic import QueueDataset, keep_queue
from .plain import check_collator, check_step_loader

logger = logging.getLogger(__name__)

__all__ = ["ODCStepLoaders"]


class ODCStepLoaders:
    """Part of `ODCTrainerMixin`: lengths, token budget and the balanced loader of a map-style training set."""

    #: Whether the trainer's steps are planned from the training set (the loader's items are whole steps). GRPO
    #: trainers plan after generation instead, from the completions, and keep TRL's prompt loader.
    odc_plans_from_dataset = True

    def _odc_lengths(self, dataset: Any) -> Any:
        from ...planning import dataset_lengths

        if not getattr(dataset, "column_names", None):
            # A map-style dataset without named columns (a torch Dataset of dicts): each row's own input_ids.
            return dataset_lengths(dataset, length_fn=_row_length)
        return dataset_lengths(dataset)

    def _odc_plan_cost(self) -> Any:
        """What the plan charges a sample of each length: this model's training FLOPs (`cost_from_config`: attention's
        ``L^2`` term on its full-attention layers only), or the published 7B fit where its config does not say."""
        from ...planning import PUBLISHED_7B_COST, cost_from_config

        config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
        if config is not None:
            try:
                return cost_from_config(config)
            except ValueError as err:  # a config without the usual names: plan with the published shape
                logger.info("ODC plans with the published 7B cost fit: %s", err)
        return PUBLISHED_7B_COST

    def _odc_padded(self) -> bool:
        """Whether the collator pads every row of a microbatch to its longest sample; plans then count padded shapes.

        Not padded: TRL's ``padding_free`` (also set by its BFD packing) and transformers' `DataCollatorWithFlattening`.
        """
        from transformers import DataCollatorWithFlattening

        padding_free = getattr(self, "padding_free", getattr(self.args, "padding_free", False))
        packs = isinstance(self.data_collator, DataCollatorWithFlattening)
        return not padding_free and (not packs or isinstance(self._odc_collator(), PaddedRows))

    def _odc_collator(self) -> Any:
        """The collator of planned microbatches: the trainer's ``data_collator``, except for a model with recurrent
        layers (`odc_accelerate.hybrid`) and `DataCollatorWithFlattening`, whose position ids alone would let one
        packed sample's state flow into the next: with the kernels that read sequence boundaries installed, the rows
        carry them (`SequenceBoundaries`); without, each sample gets a padded row of its own (`PaddedRows`), and the
        plan counts padded shapes."""
        from transformers import DataCollatorWithFlattening

        from ...hybrid import missing_packing_kernels, recurrent_model

        collator = self.data_collator
        cached = self.__dict__.get("_odc_collator_for")
        if cached is not None and cached[0] is collator:
            return cached[1]
        chosen = collator
        model = getattr(self, "model", None)
        if isinstance(collator, DataCollatorWithFlattening) and model is not None and recurrent_model(model):
            missing = missing_packing_kernels(model)
            if missing:
                chosen = PaddedRows(collator)
                logger.warning(
                    "%s has recurrent (linear-attention) layers and %s is not installed: DataCollatorWithFlattening's "
                    "packed rows would let each sample's state flow into the next, so ODC collates each microbatch "
                    "as padded rows, one sample per row.",
                    type(getattr(model, "config", model)).__name__,
                    " / ".join(missing),
                )
            else:
                chosen = SequenceBoundaries(collator)
        self._odc_collator_for = (collator, chosen)
        return chosen

    def _odc_budget_rule(self, lengths: Any) -> BudgetRule:
        """How samples count against the token budget: their own length; by default the budget is ``max_length`` (or
        the longest sample), and without truncation an over-budget sample stops the run. The plain Trainer's
        arguments have no ``max_length``: its samples come tokenized, truncated (or not) by the script."""
        if not hasattr(self.args, "max_length"):
            return BudgetRule(
                default=int(np.max(lengths)),
                oversize="raise",
                remedy="truncate the samples when tokenizing them (tokenizer(..., truncation=True, max_length=N))",
            )
        max_length = self.args.max_length
        return BudgetRule(
            default=int(max_length) if max_length else int(np.max(lengths)),
            oversize="warn" if max_length else "raise",
            sample="sample (truncation is off: max_length=None)",
            remedy="set --max_length to truncate",
        )

    def _odc_budget_tokens(self, lengths: Any) -> np.ndarray:
        """Each sample's tokens as the budget counts them (its length; a DPO pair counts both rows)."""
        return np.asarray(lengths)

    def _odc_budget(self, lengths: Any, rule: BudgetRule | None = None, chosen: int | None = None) -> int:
        """The token budget per microbatch for ``lengths`` (`budget.token_budget` with the trainer's rule): the one
        already ``chosen`` (a stream's later steps), else the ``odc_max_tokens_per_microbatch`` option, else the
        rule's default. Raises or warns (once) when samples are over it, as the rule says."""
        tokens = self._odc_budget_tokens(lengths)
        explicit = self.odc_config.max_tokens_per_microbatch if chosen is None else chosen
        budget = token_budget(tokens, explicit, rule or self._odc_budget_rule(lengths))
        longest = int(np.max(tokens))
        if longest > budget:
            self._odc_warn_over_budget(tokens, budget, longest)
        return budget

    def _odc_warn_over_budget(self, lengths: Any, budget: int, longest: int) -> None:
        """Warn, once per trainer and on the main process only, that some samples exceed the token budget.

        The sampler still runs each of them alone in its own microbatch, so training goes on; on a GPU the budget is
        what bounds a microbatch's memory, and an over-budget microbatch can run out of memory long after the start.
        """
        if self._odc_budget_warned or not self.is_world_process_zero():
            return
        self._odc_budget_warned = True
        over = int((np.asarray(lengths) > budget).sum())
        # A stream is checked one step at a time: the figures are those of the first step with such samples.
        what = (
            "samples of a step of the training stream"
            if getattr(self, "_odc_streaming", False)
            else "training samples"
        )
        logger.warning(
            "ODC: %d of %d %s are longer than the token budget per microbatch (%d tokens); the longest has %d tokens. "
            "Each of them runs alone in a microbatch over the budget, and on a GPU the budget is what bounds a "
            "microbatch's memory. Raise --odc_max_tokens_per_microbatch to at least %d, or lower --max_length to %d.",
            over,
            len(lengths),
            what,
            budget,
            longest,
            longest,
            budget,
        )

    @staticmethod
    def _odc_is_stream(dataset: Any) -> bool:
        """Whether a training set is read as a stream (`datasets.IterableDataset`, a torch `IterableDataset`, anything
        without length and indexing) rather than through the sampler."""
        from torch.utils.data import IterableDataset

        return isinstance(dataset, IterableDataset) or not (
            hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
        )

    def get_total_train_batch_size(self, args: Any) -> int:
        # Under a plan the Trainer runs one accumulation step of whole planned steps: its own count
        # (per_device_train_batch_size x 1 x world) would miss the folded accumulation (its banner's "Total train batch
        # size", its train_samples_per_second).
        if self.odc_config.balanced and self.odc_plans_from_dataset:
            return int(self.odc_run.samples_per_step)
        return super().get_total_train_batch_size(args)

    def set_initial_training_values(self, args: Any, dataloader: Any) -> Any:
        # The first call after the Trainer built its training loader, before the model is prepared: on every rank.
        if self.odc_config.balanced and self.odc_plans_from_dataset:
            check_step_loader(self, dataloader)
        return super().set_initial_training_values(args, dataloader)

    def get_train_dataloader(self) -> DataLoader:
        if not (self.odc_config.balanced and self.odc_plans_from_dataset):
            return super().get_train_dataloader()
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if self._odc_is_stream(self.train_dataset):
            return self._odc_stream_dataloader(self.train_dataset)
        from ...planning import LengthBalancedBatchSampler, PlanName

        self._odc_streaming = False
        dataset = tcompat.remove_unused_columns(self, self.train_dataset, description="training")
        lengths = self._odc_lengths(dataset)
        # A collator that cannot collate planned microbatches is refused here, before the model is sharded.
        check_collator(
            self.data_collator,
            lengths,
            list(getattr(dataset, "column_names", None) or []),
            first_row=dataset[0] if len(dataset) else None,
        )
        config = self.odc_config
        self.odc_run = run = self.odc_run.with_token_budget(self._odc_budget(lengths))
        world = max(1, int(self.args.world_size))
        self._odc_sampler = LengthBalancedBatchSampler(
            lengths,
            world_size=world,
            rank=int(self.args.process_index),
            samples_per_step=run.samples_per_step,
            max_tokens_per_microbatch=run.max_tokens_per_microbatch,
            plan=config.effective_plan,
            shuffle=True,
            seed=int(self.args.data_seed if self.args.data_seed is not None else self.args.seed),
            drop_last=True,
            cost=self._odc_plan_cost(),
            padded=self._odc_padded(),
        )
        if config.effective_plan == PlanName.DYNAMIC:
            # Items are the step's queue of index lists; rows are fetched and collated as they are claimed.
            self._odc_dynamic_dataset, self._odc_dynamic_rows = dataset, False
            return StepDataLoader(
                QueueDataset(dataset),
                sampler=self._odc_sampler,
                batch_size=None,
                collate_fn=keep_queue,
                num_workers=self.args.dataloader_num_workers,
            )
        # batch_size=None: each sampler item (this rank's microbatch index lists) is fetched and collated as one item.
        # Not passed through accelerator.prepare: its re-sharding would split an already rank-aware plan.
        return StepDataLoader(
            StepDataset(dataset),
            sampler=self._odc_sampler,
            batch_size=None,
            collate_fn=StepCollator(self._odc_collator(), pad_empty=not config.enable),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory and self.args.device.type != "cpu",
        )


def _row_length(row: Any) -> int:
    """The length of one training row without named columns: its ``input_ids``."""
    try:
        return len(row["input_ids"])
    except (KeyError, TypeError, IndexError):
        raise ValueError(
            "ODC plans each step by the samples' lengths, but a training row has no input_ids: give the dataset an "
            "input_ids (or length) column, or rows that are dicts with input_ids."
        ) from None
