"""The balanced step loader of a streamed training set (``--dataset_streaming true``).

Every rank reads the whole stream in the same order; step ``k`` is its ``k``-th run of ``samples_per_step`` samples,
planned as the sampler plans a step (`odc_accelerate.planning.StreamingStepPlanner`), and each rank keeps its own
microbatches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from ..._compat import transformers as tcompat
from .data import StepCollator, StepDataLoader, StreamStepDataset
from .dynamic import keep_queue

__all__ = ["ODCStreamLoaders"]


class ODCStreamLoaders:
    """Part of `ODCTrainerMixin`: the balanced loader of a stream and the checks of its first step."""

    def _odc_stream_dataloader(self, stream: Any) -> DataLoader:
        """The balanced step loader of a stream (`datasets.IterableDataset`, e.g. ``--dataset_streaming true``).

        Every rank reads the whole stream in the same order; step ``k`` is its ``k``-th run of ``samples_per_step``
        samples, planned as the sampler plans a step (`odc_accelerate.planning.StreamingStepPlanner`), and each rank
        keeps its own microbatches. The first step is read here, before training, to check the settings and that
        every rank reads the same samples; later steps are checked against the token budget as they come.
        """
        from ...planning import PlanName, StreamingStepPlanner

        config, args = self.odc_config, self.args
        if args.dataloader_num_workers:
            raise ValueError(
                "With a streamed training set every rank reads the whole stream in its main process, while each "
                "dataloader worker would read only some of the stream's shards. Set --dataloader_num_workers 0 (it is "
                f"{args.dataloader_num_workers}), or load the dataset without streaming."
            )
        if config.max_tokens_per_microbatch is None and not getattr(args, "max_length", None):
            raise ValueError(
                "The longest sample of a streamed training set is not known before training, so the ODC token budget "
                "per microbatch cannot be derived from it. Set --odc_max_tokens_per_microbatch, or set --max_length "
                "(samples are truncated to it and the budget follows from it)."
            )
        self._odc_streaming = True
        samples_per_step = self.odc_run.samples_per_step
        columns, lengths = self._odc_stream_first_step(stream, samples_per_step)
        # Fixed for the whole stream: later steps are checked against it (`_odc_stream_lengths`).
        self.odc_run = run = self.odc_run.with_token_budget(self._odc_budget(lengths))
        planner = StreamingStepPlanner(
            max(1, int(args.world_size)),
            samples_per_step,
            run.max_tokens_per_microbatch,
            plan=config.effective_plan,
            cost=self._odc_plan_cost(),
            padded=self._odc_padded(),
        )
        dynamic = config.effective_plan == PlanName.DYNAMIC
        steps = StreamStepDataset(
            stream,
            planner,
            int(args.process_index),
            lengths_fn=self._odc_stream_lengths,
            columns=columns,
            queue=dynamic,
        )
        self._odc_dynamic_rows = dynamic  # a dynamic queue holds the rows themselves, collated as they are claimed
        # Not passed through accelerator.prepare: its re-sharding would split an already rank-aware plan.
        return StepDataLoader(
            steps,
            batch_size=None,
            collate_fn=keep_queue if dynamic else StepCollator(self._odc_collator(), pad_empty=not config.enable),
            num_workers=0,
            pin_memory=args.dataloader_pin_memory and args.device.type != "cpu",
        )

    def _odc_stream_lengths(self, rows: list[dict]) -> Any:
        """Lengths of one step of a stream, as `_odc_lengths` computes them, checked against the fixed token budget."""
        from ...planning import StepRows

        lengths = self._odc_lengths(StepRows(rows))
        # The budget chosen at the first step: raises for samples it cannot hold, warns for longer ones.
        self._odc_budget(lengths, chosen=self.odc_run.max_tokens_per_microbatch)
        return lengths

    def _odc_stream_first_step(self, stream: Any, samples_per_step: int) -> tuple[list[str] | None, Any]:
        """Read the stream's first step on every rank: the columns to keep (the Trainer's unused-column removal) and
        the step's lengths. Raises, on every rank at once, when the stream holds less than one step, when a rank
        cannot read it, or when the ranks read different samples (a stream split by rank, or shuffled unseeded)."""
        import hashlib
        import itertools

        from ...planning import StepRows

        rows: list[Any] = []
        columns, lengths, error = None, None, None
        try:
            set_epoch = getattr(stream, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(0)  # the first pass, as StreamingStepPlanner.steps reads it
            rows = list(itertools.islice(iter(stream), samples_per_step))
            step = StepRows(rows)
            if rows and self.args.remove_unused_columns:
                step = tcompat.remove_unused_columns(self, step, description="training")
                columns = step.column_names
            if len(rows) == samples_per_step:
                lengths = self._odc_lengths(step)
            digest = int.from_bytes(hashlib.blake2b(repr(step.rows).encode(), digest_size=7).digest(), "little")
        except Exception as err:  # noqa: BLE001 - re-raised below, once every rank knows (no rank left waiting)
            error, digest = err, 0
        mine = [int(error is None), len(rows), digest]
        table = [mine]
        if self.accelerator.num_processes > 1:
            local = torch.tensor([mine], dtype=torch.int64, device=self.args.device)
            table = self.accelerator.gather(local).view(-1, 3).tolist()
        if error is not None:
            raise error
        failed = [rank for rank, (ok, _, _) in enumerate(table) if not ok]
        if failed:
            raise RuntimeError(
                f"Rank(s) {failed} could not read the first step of the training stream (see their error)."
            )
        if len(rows) < samples_per_step:
            raise ValueError(
                f"The training stream has {len(rows)} sample(s), fewer than the {samples_per_step} samples of one "
                "optimizer step (samples_per_step): there is no complete step to train. Use a larger dataset, or lower "
                "--per_device_train_batch_size / --gradient_accumulation_steps (or --odc_samples_per_step)."
            )
        if len({(n, d) for _, n, d in table}) > 1:
            raise ValueError(
                "The ranks read different samples at the start of the training stream. ODC plans each step from the "
                "same samples on every rank, so every rank must read the whole stream in the same order: do not split "
                "it by rank (datasets.distributed.split_dataset_by_node) and give any shuffle a seed "
                "(IterableDataset.shuffle(seed=...))."
            )
        return columns, lengths
