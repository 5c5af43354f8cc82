"""`ODCTrainerMixin`: runs a `transformers.Trainer` (or TRL trainer) with ODC.

What the mixin changes, and why:

* **Accelerator.** The Trainer has no argument for a plugin, so the mixin builds an `ODCPlugin` (FSDP2 + ODC engine)
  from the resolved `ODCConfig` and the launch's FSDP settings, and refuses FSDP1, DDP or no FSDP with one error.
* **One dataloader item = this rank's whole optimizer step.** A `LengthBalancedBatchSampler` plans every step over
  all ranks (``samples_per_step = per_device_train_batch_size x gradient_accumulation_steps x world_size`` unless set),
  and each rank gets its own list of microbatches, so ranks may run different numbers of microbatches. The
  Trainer's gradient accumulation would count microbatches globally and deadlock, so it runs with
  ``gradient_accumulation_steps=1`` and ``training_step`` loops the microbatches itself; the effective batch is
  unchanged. accelerate's re-sharding of the dataloader is bypassed (the sampler is already rank-aware). With a
  padded collator the plan is made on padded shapes. As in the Trainer's own loop, every microbatch but a rank's last
  runs under ``accelerator.no_sync``: gradients accumulate locally and are reduced (ODC: scatter-added) once per step,
  unless accelerate's ``sync_each_batch`` asks for every microbatch.
* **Exact loss.** ``num_items_in_batch`` is the number of label tokens of the whole step over all ranks (one
  all-reduce at the step start, before any microbatch); every microbatch's summed token loss is divided by it and
  multiplied by the world size (the Trainer's ``average_tokens_across_devices`` scaling), which is
  `odc_accelerate.loss_scale`: the loss equals one process's per-token mean over the global batch.
* **No collective inside a step.** ``accelerator.gather_for_metrics`` calls made during the microbatches (TRL makes
  several per microbatch) are answered locally and recorded; one all-reduce at the step boundary produces the global
  values (see `metrics.reduce_step_metrics` and `ODCTrainerMixin._odc_finalize_metrics`).
* **Step boundary.** ``engine.pre_optimizer_step()`` runs at the end of ``training_step``, so the Trainer's grad-norm
  and clipping see the final gradients; `ODCCallback.on_optimizer_step` calls ``engine.post_optimizer_step()``.
* **Metrics** (logged with the loss, so they land in ``trainer_state.json``'s ``log_history``): ``odc/tokens_per_s``
  (non-padding input tokens of all ranks per second of wall time), ``odc/step_s``, ``odc/microbatches_min|max``,
  per-rank ``odc/busy_s_rank<r>`` (the rank's own forward and backward) and ``odc/wait_s_rank<r>`` (the rest of the
  step: barriers, metric reductions, collectives, the optimizer), ``odc/bubble_pct`` (see `metrics.StepTimer`). Plain
  FSDP2 runs through this mixin log the same keys, measured the same way; ``odc_time_collectives`` makes FSDP2's
  waits inside its per-layer collectives count as wait instead of busy.
* **Streams.** A training set without length or indexing (``--dataset_streaming true``) is planned one step at a
  time: every rank reads the whole stream and keeps its own microbatches (`~odc_accelerate.planning.StreamingStepPlanner`).
* **Checkpoints.** After the Trainer loads weights, ``engine.republish()`` makes peers read the loaded shards. The
  sampler is deterministic (seed, epoch, step) and a stream is read in its own order, so skipping the trained steps
  resumes the exact data order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..._compat import transformers as tcompat
from ...config import ODCConfig
from ...validation import str_to_bool
from ..accelerate import ODCPlugin, enable, get_engine
from .callback import ODCCallback
from .data import StepCollator, StepDataLoader, StepDataset, StreamStepDataset, merge_for_counting
from .metrics import DeferredGather, StepMetrics, StepTimer, reduce_step_metrics

logger = logging.getLogger(__name__)

__all__ = ["ODCTrainerMixin"]


class ODCTrainerMixin:
    """Mixin that runs a `transformers.Trainer` (or TRL trainer) with ODC; put it first in the bases.

    ODC settings come from the training arguments' ``odc`` / ``odc_*`` fields (see
    `odc_accelerate.integrations.trl.ODCSFTConfig`), the ODC keys of ``fsdp_config``, or ``ODC_*`` environment
    variables, in that order (see `ODCConfig.from_sources`). The launch must be FSDP2 (an accelerate config with
    ``distributed_type: FSDP`` and ``fsdp_version: 2``); on CPU it runs with gloo and shared memory.

    Attributes:
        odc_config (`ODCConfig`): the resolved settings.
        odc_engine (`ODCEngine` or `None`): the engine, once the model is prepared.
        odc_step_timer (`StepTimer`): per-step timing behind the ``odc/*`` metrics.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        enable()
        tcompat.check()
        tcompat.passthrough_skip_first_batches()
        self._odc_sampler = None
        self._odc_looping = False  # inside the balanced step's microbatch loop (loss scaling of subclasses)
        self._odc_budget_warned = False  # the over-budget warning is given once per trainer
        super().__init__(*args, **kwargs)
        self.add_callback(ODCCallback(self))

    # ------------------------------------------------------------------ accelerator
    def create_accelerator_and_postprocess(self) -> None:
        self.odc_config = ODCConfig.from_sources(args=self.args)
        config = self.odc_config
        self.odc_step_timer = StepTimer(
            rank=int(getattr(self.args, "process_index", 0)),
            trace_dir=config.trace_dir,
            time_collectives=config.time_collectives,
        )
        if config.balanced:
            world = max(1, int(getattr(self.args, "world_size", 1)))
            ga = int(self.args.gradient_accumulation_steps)
            if config.samples_per_step is None:
                config.samples_per_step = int(self.args.per_device_train_batch_size) * ga * world
            if ga != 1:
                # Ranks may run different numbers of microbatches: the Trainer's accumulation counts them globally,
                # so one dataloader item holds this rank's whole step instead (the effective batch is unchanged).
                logger.info(
                    "ODC: gradient_accumulation_steps=%d folded into samples_per_step=%d; the Trainer runs 1 "
                    "accumulation step per optimizer step.",
                    ga,
                    config.samples_per_step,
                )
                self.args.gradient_accumulation_steps = 1
        super().create_accelerator_and_postprocess()
        if config.enable:
            from accelerate.utils import DistributedType

            state = self.accelerator.state
            plugin = getattr(state, "fsdp_plugin", None)
            if state.distributed_type != DistributedType.FSDP or not isinstance(plugin, ODCPlugin):
                raise ValueError(
                    f"ODC needs FSDP2 across several processes, but this run is {state.distributed_type} with "
                    f"{state.num_processes} process(es). Launch with `accelerate launch --config_file <cfg>` where the "
                    "config has `distributed_type: FSDP`, `fsdp_version: 2` and num_processes >= 2."
                )

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        config = self.odc_config
        if config.enable:
            plugin_args = dict(getattr(self.args, "fsdp_plugin_args", None) or {})
            launched_fsdp = str_to_bool(os.environ.get("ACCELERATE_USE_FSDP", "false"), "ACCELERATE_USE_FSDP")
            if not plugin_args and not launched_fsdp:
                raise ValueError(
                    "ODC needs FSDP2, but this run does not use FSDP (plain DDP or a single process). Launch with an "
                    "accelerate config that has `distributed_type: FSDP` and `fsdp_version: 2` (e.g. "
                    "examples/sft/configs/odc_cpu.yaml), or pass `--fsdp full_shard` with `fsdp_version: 2`."
                )
            version = plugin_args.get("fsdp_version") or (
                os.environ.get("FSDP_VERSION", "1") if launched_fsdp and not plugin_args else 2
            )
            if int(version) != 2:
                raise ValueError(
                    f"ODC needs FSDP2, but the FSDP config asks for FSDP{int(version)}. Set `fsdp_version: 2` in the "
                    "accelerate config's fsdp_config (or in --fsdp_config)."
                )
            plugin_args.pop("fsdp_version", None)
            kwargs["fsdp_plugin"] = ODCPlugin(fsdp_version=2, **config.options(), **plugin_args)
        return super()._build_accelerator_args(**kwargs)

    @property
    def odc_engine(self) -> Any:
        accelerator = getattr(self, "accelerator", None)
        return get_engine(accelerator) if accelerator is not None else None

    # ------------------------------------------------------------------ data
    def _odc_lengths(self, dataset: Any) -> Any:
        from ...planning import dataset_lengths

        return dataset_lengths(dataset)

    def _odc_padded(self) -> bool:
        """Whether the collator pads every row of a microbatch to its longest sample; plans then count padded shapes.

        Not padded: TRL's ``padding_free`` (also set by its BFD packing) and transformers' `DataCollatorWithFlattening`.
        """
        from transformers import DataCollatorWithFlattening

        padding_free = getattr(self, "padding_free", getattr(self.args, "padding_free", False))
        return not padding_free and not isinstance(self.data_collator, DataCollatorWithFlattening)

    def _odc_budget(self, lengths: Any) -> int:
        budget = self.odc_config.max_tokens_per_microbatch
        max_length = getattr(self.args, "max_length", None)
        if budget is None:
            budget = int(max_length) if max_length else int(max(lengths))
        longest = int(max(lengths))
        if longest > budget and not max_length:
            raise ValueError(
                f"The ODC token budget per microbatch ({budget}) is smaller than the longest sample ({longest} tokens) "
                f"and truncation is off (max_length=None). Raise --odc_max_tokens_per_microbatch to at least {longest} "
                "or set --max_length to truncate."
            )
        if longest > budget:
            self._odc_warn_over_budget(lengths, budget, longest)
        return int(budget)

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

    def get_train_dataloader(self) -> DataLoader:
        if not self.odc_config.balanced:
            return super().get_train_dataloader()
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if self._odc_is_stream(self.train_dataset):
            return self._odc_stream_dataloader(self.train_dataset)
        from ...planning import LengthBalancedBatchSampler

        self._odc_streaming = False
        dataset = self._remove_unused_columns(self.train_dataset, description="training")
        lengths = self._odc_lengths(dataset)
        config = self.odc_config
        config.max_tokens_per_microbatch = self._odc_budget(lengths)
        world = max(1, int(self.args.world_size))
        self._odc_sampler = LengthBalancedBatchSampler(
            lengths,
            world_size=world,
            rank=int(self.args.process_index),
            samples_per_step=int(config.samples_per_step),
            max_tokens_per_microbatch=config.max_tokens_per_microbatch,
            plan=config.plan,
            shuffle=True,
            seed=int(self.args.data_seed if self.args.data_seed is not None else self.args.seed),
            drop_last=True,
            padded=self._odc_padded(),
        )
        # batch_size=None: each sampler item (this rank's microbatch index lists) is fetched and collated as one item.
        # Not passed through accelerator.prepare: its re-sharding would split an already rank-aware plan.
        return StepDataLoader(
            StepDataset(dataset),
            sampler=self._odc_sampler,
            batch_size=None,
            collate_fn=StepCollator(self.data_collator),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    def _odc_stream_dataloader(self, stream: Any) -> DataLoader:
        """The balanced step loader of a stream (`datasets.IterableDataset`, e.g. ``--dataset_streaming true``).

        Every rank reads the whole stream in the same order; step ``k`` is its ``k``-th run of ``samples_per_step``
        samples, planned as the sampler plans a step (`odc_accelerate.planning.StreamingStepPlanner`), and each rank
        keeps its own microbatches. The first step is read here, before training, to check the settings and that
        every rank reads the same samples; later steps are checked against the token budget as they come.
        """
        from ...planning import StreamingStepPlanner

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
        samples_per_step = int(config.samples_per_step)
        columns, lengths = self._odc_stream_first_step(stream, samples_per_step)
        config.max_tokens_per_microbatch = self._odc_budget(lengths)
        planner = StreamingStepPlanner(
            max(1, int(args.world_size)),
            samples_per_step,
            config.max_tokens_per_microbatch,
            plan=config.plan,
            padded=self._odc_padded(),
        )
        steps = StreamStepDataset(
            stream, planner, int(args.process_index), lengths_fn=self._odc_stream_lengths, columns=columns
        )
        # Not passed through accelerator.prepare: its re-sharding would split an already rank-aware plan.
        return StepDataLoader(
            steps,
            batch_size=None,
            collate_fn=StepCollator(self.data_collator),
            num_workers=0,
            pin_memory=args.dataloader_pin_memory,
        )

    def _odc_stream_lengths(self, rows: list[dict]) -> Any:
        """Lengths of one step of a stream, as `_odc_lengths` computes them, checked against the fixed token budget."""
        from ...planning import StepRows

        lengths = self._odc_lengths(StepRows(rows))
        self._odc_budget(lengths)  # the budget is set: raises for samples it cannot hold, warns for longer ones
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
                step = self._remove_unused_columns(step, description="training")
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

    def _run_epoch(self, **kwargs: Any) -> Any:
        loader = kwargs.get("train_dataloader")
        steps = loader.dataset if isinstance(loader, StepDataLoader) else None
        if isinstance(steps, StreamStepDataset):
            resuming = kwargs.get("resume_from_checkpoint") is not None and kwargs["epoch"] == kwargs.get(
                "epochs_trained"
            )
            if resuming:
                # Exact resume: each optimizer step trained one step of the stream, so the stream restarts after as
                # many steps as the checkpoint trained (passes included); ignore_data_skip restarts it from the start.
                steps.start_step = 0 if self.args.ignore_data_skip else int(self.state.global_step)
            else:
                steps.start_step = steps.steps_consumed  # a later Trainer epoch continues the stream where it is
        sampler = self._odc_sampler
        if sampler is not None and isinstance(kwargs.get("train_dataloader"), StepDataLoader):
            # The Trainer only calls set_epoch on samplers it recognises; the plan depends on (seed, epoch, step).
            epoch = int(kwargs["epoch"])
            sampler.set_epoch(epoch)
            skip = int(kwargs.get("steps_trained_in_current_epoch") or 0)
            resuming = kwargs.get("resume_from_checkpoint") is not None and epoch == kwargs.get("epochs_trained")
            if resuming and skip and not self.args.ignore_data_skip:
                # Exact resume: start at the step an uninterrupted run would train next (no batch is fetched to be
                # thrown away; the Trainer's own skip is a no-op for this loader).
                sampler.load_state_dict({"epoch": epoch, "steps_consumed": skip, "seed": sampler.seed})
        return super()._run_epoch(**kwargs)

    # ------------------------------------------------------------------ step
    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        start = time.perf_counter()
        if not self.odc_config.balanced:
            # The Trainer's own microbatching: timed the same way, so plain runs log comparable step figures.
            batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
            self.odc_step_timer.start(self.model, self.odc_engine, batches, start)
            return batches, num_items
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        if not batch_samples:
            return batch_samples, None
        microbatches = [mb for item in batch_samples for mb in item]
        counts = torch.tensor([self._odc_num_items(microbatches)], dtype=torch.float64, device=device)
        if self.accelerator.num_processes > 1:
            # The one collective of the step before its microbatches: the global count of loss items.
            counts = self.accelerator.reduce(counts, reduction="sum")
        self.odc_step_timer.start(self.model, self.odc_engine, microbatches, start)
        num_items = torch.tensor(int(counts[0]), device=device)
        return [microbatches], num_items

    def _odc_num_items(self, microbatches: list[Any]) -> int:
        """What this rank's loss of the step is normalised over: label tokens (a token-mean loss). The DPO trainer
        counts pairs instead."""
        return sum(tcompat.count_label_tokens(self, mb) for mb in microbatches)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        if not isinstance(inputs, list):
            # The Trainer's own microbatching (plain runs): one call per microbatch, timed as the balanced path's.
            with self.odc_step_timer.compute(self.args.device):
                return super().training_step(model, inputs, num_items_in_batch)
        engine = self.odc_engine
        deferred = DeferredGather()
        real_gathers = self.accelerator.gather_for_metrics, self.accelerator.gather, self.accelerator.reduce
        total = torch.zeros((), device=self.args.device)
        self.accelerator.gather_for_metrics = deferred  # type: ignore[method-assign]
        self.accelerator.gather = deferred  # type: ignore[method-assign]
        self.accelerator.reduce = deferred.reduce  # type: ignore[method-assign]
        # As the Trainer does for its own microbatches: gradients stay local (unsharded) until the rank's last
        # microbatch, so FSDP2 reduce-scatters (and ODC scatter-adds) once per step instead of once per microbatch.
        # Accelerate's `sync_each_batch=True` trades that back for memory. Ranks may run different counts: ODC's
        # reduce-scatter is one-sided, and the lockstep plan gives every rank the same number of microbatches.
        sync_each_batch = bool(self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False))
        self._odc_looping = True
        try:
            for i, mb in enumerate(inputs):
                deferred.start_microbatch()
                sync = sync_each_batch or i == len(inputs) - 1
                with (
                    contextlib.nullcontext() if sync else self.accelerator.no_sync(model=model),
                    self.odc_step_timer.compute(self.args.device),
                ):
                    total += super().training_step(model, mb, num_items_in_batch)
        finally:
            self._odc_looping = False
            (  # type: ignore[method-assign]
                self.accelerator.gather_for_metrics,
                self.accelerator.gather,
                self.accelerator.reduce,
            ) = real_gathers
        # Outside the timed compute: a rank that finished its microbatches early waits here and in the barrier below.
        metrics = reduce_step_metrics(deferred, self._odc_gather(), self.args.device)
        if metrics is not None:
            self._odc_finalize_metrics(metrics)
        if engine is not None:
            engine.pre_optimizer_step()  # before the Trainer's grad-norm / clipping
        return total

    def _odc_gather(self) -> Any:
        return self.accelerator.gather if self.accelerator.num_processes > 1 else None

    def _odc_finalize_metrics(self, metrics: StepMetrics) -> None:
        """Replace what the trainer recorded from locally answered metric gathers with the step's global values.

        Trainer subclasses know what their gathers mean (see the TRL trainers); the base Trainer makes none during
        microbatches.
        """

    def odc_after_optimizer_step(self) -> None:
        """Close the step after the optimizer: publish the new shards, record the step's timing."""
        engine = self.odc_engine
        if engine is not None:
            engine.post_optimizer_step()
        self.odc_step_timer.end(engine, time.perf_counter())

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.odc_step_timer.pending and "loss" in logs:
            gather = self.accelerator.gather if self.accelerator.num_processes > 1 else None
            logs.update(self.odc_step_timer.interval_metrics(gather, self.args.device))
        super().log(logs, *args, **kwargs)

    def _track_num_input_tokens(self, inputs: Any) -> None:
        if isinstance(inputs, list):
            inputs = merge_for_counting(inputs, getattr(self.model, "main_input_name", "input_ids"))
        return super()._track_num_input_tokens(inputs)

    def floating_point_ops(self, inputs: Any) -> int:
        if not isinstance(inputs, list):
            return super().floating_point_ops(inputs)
        total = 0
        for mb in inputs:  # a loop, not a generator: zero-argument super() needs this frame
            total += super().floating_point_ops(mb)
        return total

    # ------------------------------------------------------------------ checkpoints
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        engine = self.odc_engine
        if engine is not None:
            engine.republish()  # peers would otherwise read the shards published before loading
