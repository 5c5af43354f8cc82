"""The balanced step of the ODC Trainer: this rank's microbatches, exact loss, no collective inside the step.

One all-reduce at the step start counts the step's loss items (and rows) over all ranks; each microbatch's loss is
scaled by `odc_accelerate.loss_scale` (or `odc_accelerate.loss.batch_mean_weight` for a per-batch mean). Metric
gathers during the microbatches are answered locally and reduced at the step boundary. A `ZeroWeightMicrobatch` (an
empty ``lockstep`` slot under plain FSDP2) runs with its loss scaled by 0 so FSDP2's collectives stay paired.
``engine.pre_optimizer_step()`` runs at the end of ``training_step``, before the Trainer's clipping.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from ..._compat import accelerate as accelerate_compat
from ..._compat import transformers as tcompat
from ...loss import batch_mean_weight
from .data import ZeroWeightMicrobatch, merge_for_counting, microbatch_rows
from .dynamic import ClaimedStep, ClaimQueue
from .metrics import DeferredGather, StepMetrics, reduce_step_metrics
from .moe import routed_tokens, router_aux_loss_coef
from .plain import is_trl_trainer, step_items, uses_trainer_loss, weights_batch_mean_loss

__all__ = ["ODCStepLoop"]


class ODCStepLoop:
    """Part of `ODCTrainerMixin`: the step's microbatch loop, loss normalisation, step metrics and logging."""

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        start = time.perf_counter()
        self._odc_banner()
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
        if isinstance(batch_samples[0], ClaimQueue):
            return self._odc_claimed_step(batch_samples, device, start)
        microbatches = [mb for item in batch_samples for mb in item]
        real = _weighted(microbatches)
        rows = sum(microbatch_rows(mb) for mb in real)
        routed = sum(routed_tokens(mb) for mb in real) if self._odc_weights_router_aux() else 0
        # Timed from here: a trainer's own per-step pass (`_odc_step_sums`, KTO's KL estimate) is this rank's work.
        self.odc_step_timer.start(self.model, self.odc_engine, real, start)
        self.odc_step_timer.add_work(len(microbatches) - len(real), 0)  # zero-weight microbatches: compute only
        sums = [self._odc_num_items(real), rows, routed, *self._odc_step_sums(microbatches)]
        counts = torch.tensor(sums, dtype=torch.float64, device=device)
        if self.accelerator.num_processes > 1:
            # The one collective of the step before its microbatches: the global counts of loss items, rows and
            # routed tokens.
            counts = self.accelerator.reduce(counts, reduction="sum")
        self._odc_step_rows = int(counts[1])
        self._odc_step_routed = int(counts[2])
        self._odc_step_reduced(counts[3:].tolist())
        num_items = torch.tensor(int(counts[0]), device=device)
        return [microbatches], num_items

    def _odc_claimed_step(self, items: list[ClaimQueue], device: torch.device, start: float) -> tuple[list, Any]:
        """Start a step of the ``dynamic`` plan: the global count of loss items before the first claim."""
        queue = ClaimQueue([mb for item in items for mb in item.microbatches], rows=items[0].rows)
        step = ClaimedStep(queue, self._odc_load_microbatch)
        self._odc_step_rows = sum(len(mb) for mb in queue.microbatches)  # the step's samples, known to every rank
        # The routed tokens of a router's auxiliary loss need the microbatches collated, as label tokens do.
        count = None if self._odc_weights_router_aux() else self._odc_queue_items(step)
        if count is None:
            # Each rank counts a 1/W share of the queue (collated now, kept for its own later claims); one all-reduce.
            rank, world = int(self.args.process_index), self.accelerator.num_processes
            share = [step.peek(i) for i in range(rank, len(queue), world)]
            routed = sum(routed_tokens(mb) for mb in share) if self._odc_weights_router_aux() else 0
            counts = torch.tensor([self._odc_num_items(share), routed], dtype=torch.float64, device=device)
            if world > 1:
                counts = self.accelerator.reduce(counts, reduction="sum")
            count = int(counts[0])
            self._odc_step_routed = int(counts[1])
        self.odc_step_timer.start(self.model, self.odc_engine, [], start)
        return [step], torch.tensor(int(count), device=device)

    def _odc_step_sums(self, microbatches: list[Any]) -> list[float]:
        """Values of this rank's step (before its microbatches) that the step's one all-reduce sums over ranks for
        `_odc_step_reduced`; none here (KTO: its KL estimate)."""
        return []

    def _odc_step_reduced(self, sums: list[float]) -> None:
        """Receive the sums over ranks of `_odc_step_sums`."""

    def _odc_queue_items(self, step: ClaimedStep) -> int | None:
        """The step's global count of loss items from its queue alone, or `None` when the microbatches must be collated
        to count them (label tokens). The DPO trainer counts pairs."""
        return None

    def _odc_count_claimed(self, batch: Any) -> None:
        """Book a claimed microbatch's work in the step's timing (its count, tokens and traced shape)."""
        self.odc_step_timer.add_microbatch(batch)

    def _odc_load_microbatch(self, microbatch: list[Any]) -> Any:
        """Fetch (map-style: by index) and collate one microbatch of a ``dynamic`` queue; the loads and their time are
        counted in ``odc_dynamic_loads`` (``[microbatches, seconds]``)."""
        start = time.perf_counter()
        collator = self._odc_collator()
        if self._odc_dynamic_rows:
            batch = collator(microbatch)
        else:
            batch = collator([self._odc_dynamic_dataset[i] for i in microbatch])
        self.odc_dynamic_loads[0] += 1
        self.odc_dynamic_loads[1] += time.perf_counter() - start
        return batch

    #: Whether the trainer weights a router's auxiliary loss per microbatch (`_odc_router_coef`, `moe`); the others
    #: refuse it under a plan.
    _odc_serves_router_aux_loss = False
    #: The position of TRL's ``aux_loss`` gather among a microbatch's metric gathers (its logged value is weighted).
    _odc_aux_gather_position: int | None = None
    #: The current microbatch's share of the step's routed tokens while its loss is computed (`None` otherwise), and
    #: the step's routed tokens over all ranks.
    _odc_aux_share: float | None = None
    _odc_step_routed = 0

    def _odc_router_aux_served(self) -> bool:
        """Whether the trainer's loss has its router term weighted per microbatch: a TRL trainer's ODC class says so
        (``_odc_serves_router_aux_loss``); a plain Trainer's own ``compute_loss`` (the model's loss, to which its
        forward adds the term) is weighted through the model's coefficient (`_odc_plain_router_coef`), a
        ``compute_loss_func`` or a ``compute_loss`` of a subclass is not."""
        if is_trl_trainer(self):
            return self._odc_serves_router_aux_loss
        return self._odc_plain_loss_owner() is None

    def _odc_plain_loss_owner(self) -> str | None:
        """What computes a plain Trainer's loss instead of the Trainer's own ``compute_loss`` (a subclass's
        ``compute_loss``, a ``compute_loss_func``), or `None`."""
        if is_trl_trainer(self):
            return None
        if not uses_trainer_loss(self):
            owner = next(cls for cls in type(self).__mro__ if "compute_loss" in vars(cls))
            return f"{owner.__qualname__}.compute_loss"
        # the Trainer sets compute_loss_func after its accelerator: the mixin kept the argument before
        given = getattr(self, "compute_loss_func", None) or getattr(self, "_odc_compute_loss_func", None)
        return "compute_loss_func" if given is not None else None

    def _odc_weights_router_aux(self) -> bool:
        if not (self.odc_config.balanced and self._odc_router_aux_served()):
            return False
        if is_trl_trainer(self):
            return bool(getattr(self, "aux_loss_enabled", False))
        return router_aux_loss_coef(self.model, self.args) != 0.0

    def _odc_plain_router_coef(self, model: Any, items: Any, weight: float) -> contextlib.AbstractContextManager:
        """Within the block (a plain Trainer's microbatch), the model's forward adds its router term times the
        microbatch's share of the step's routed tokens, over what the Trainer and the step multiply the model's loss
        by (``W`` where the Trainer averages tokens across devices, and the step's ``weight``): the term's weighted
        share of the step, as for the TRL trainers."""
        share = self._odc_aux_share
        if share is None or is_trl_trainer(self):
            return contextlib.nullcontext()
        world = self.accelerator.num_processes
        # transformers.Trainer.compute_loss multiplies the loss by the world size in this case (its own rule)
        scaled = bool(
            self.args.average_tokens_across_devices
            and (self.model_accepts_loss_kwargs or self.compute_loss_func)
            and items is not None
        )
        factor = share * world / ((world if scaled else 1) * weight) if share and weight else 0.0
        return tcompat.scaled_router_aux_loss_coef(model, factor)

    @contextlib.contextmanager
    def _odc_router_coef(self, scale: float) -> Iterator[None]:
        """Within the block (a planned microbatch's loss), TRL's ``router_aux_loss_coef`` is multiplied by that
        microbatch's share of the step's routed tokens times ``scale``: what turns TRL's per-microbatch term into its
        weighted share of the step (``scale`` undoes what the trainer multiplies the term by besides the
        coefficient: the world size FSDP2 averages over, over any loss weight)."""
        share = self._odc_aux_share
        if share is None:
            yield
            return
        coef = self.router_aux_loss_coef
        self.router_aux_loss_coef = coef * share * scale
        try:
            yield
        finally:
            self.router_aux_loss_coef = coef

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
        # With ODC the engine's memory policy decides, per param group, whether gradients stay unsharded until the
        # step boundary (one scatter-add per step) or are scatter-added after every microbatch. Plain FSDP2 (ODC
        # off) does as the Trainer does for its own microbatches: gradients stay local until the rank's last
        # microbatch (the lockstep plan gives every rank the same count); accelerate's `sync_each_batch=True` trades
        # that back for memory. (A memory policy that keeps gradients is refused with it when the engine attaches.)
        asked_each_batch = accelerate_compat.sync_each_batch(self.accelerator)
        deferred = DeferredGather()
        real_gathers = self.accelerator.gather_for_metrics, self.accelerator.gather, self.accelerator.reduce
        total = torch.zeros((), device=self.args.device)
        self.accelerator.gather_for_metrics = deferred  # type: ignore[method-assign]
        self.accelerator.gather = deferred  # type: ignore[method-assign]
        self.accelerator.reduce = deferred.reduce  # type: ignore[method-assign]
        sync_each_batch = engine is not None or asked_each_batch
        dynamic = isinstance(inputs, ClaimedStep)
        if dynamic:
            # Claimed one at a time as the loop asks (`ODCEngine.claim_microbatches`); one process claims them all.
            indices = engine.claim_microbatches(len(inputs.queue)) if engine is not None else range(len(inputs.queue))
            microbatches = inputs.claimed(indices)
        else:
            microbatches = inputs
        self._odc_looping = True
        try:
            for i, mb in enumerate(microbatches):
                zero_weight = isinstance(mb, ZeroWeightMicrobatch)
                if zero_weight:
                    mb = mb.batch
                deferred.start_microbatch(zero_weight=zero_weight)
                if dynamic:
                    self._odc_count_claimed(mb)
                # dynamic: whether a microbatch was the rank's last is known only at its next claim (see `dynamic`)
                sync = dynamic or sync_each_batch or i == len(inputs) - 1
                items = step_items(self, mb, num_items_in_batch)
                weight = 0.0 if zero_weight else 1.0
                if self._odc_weights_router_aux():
                    # The microbatch's share of the step's routed tokens over all ranks (0 for a zero-weight one)
                    self._odc_aux_share = 0.0 if zero_weight else routed_tokens(mb) / max(self._odc_step_routed, 1)
                if not zero_weight and weights_batch_mean_loss(self, items):
                    weight = batch_mean_weight(
                        microbatch_rows(mb), self._odc_step_rows, self.accelerator.num_processes
                    )
                with (
                    contextlib.nullcontext() if sync else self.accelerator.no_sync(model=model),
                    _scaled_backward(self.accelerator, weight) if weight != 1.0 else contextlib.nullcontext(),
                    self._odc_plain_router_coef(model, items, weight),
                    self.odc_step_timer.compute(self.args.device),
                ):
                    loss = super().training_step(model, mb, items)
                if not zero_weight:
                    total += loss * weight
                if self._odc_aux_share is not None and self._odc_aux_gather_position is not None:
                    # The logged aux_loss: the microbatch's term times its share, summed over the step's microbatches
                    deferred.scale_call(self._odc_aux_gather_position, self._odc_aux_share)
        finally:
            self._odc_looping = False
            self._odc_aux_share = None
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
            # Before the Trainer's grad-norm / clipping; the ranks also check that their optimizers group the
            # parameters alike.
            engine.pre_optimizer_step(self.optimizer)
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
        timer, wanted = self.odc_step_timer, self.odc_config.metrics
        if timer.pending and "loss" in logs:
            if wanted == "off":  # the same setting on every rank: no rank gathers
                timer.pending.clear()
            else:
                gather = self.accelerator.gather if self.accelerator.num_processes > 1 else None
                logs.update(timer.interval_metrics(gather, self.args.device, per_rank=wanted == "per_rank"))
        super().log(logs, *args, **kwargs)

    def _track_num_input_tokens(self, inputs: Any) -> None:
        if isinstance(inputs, list):
            inputs = merge_for_counting(_weighted(inputs), getattr(self.model, "main_input_name", "input_ids"))
        return super()._track_num_input_tokens(inputs)

    def floating_point_ops(self, inputs: Any) -> int:
        if not isinstance(inputs, list):
            return super().floating_point_ops(inputs)
        total = 0
        for mb in _weighted(inputs):  # a loop, not a generator: zero-argument super() needs this frame
            total += super().floating_point_ops(mb)
        return total


def _weighted(microbatches: list[Any]) -> list[Any]:
    """The microbatches that count (all but the zero-weight ones)."""
    return [mb for mb in microbatches if not isinstance(mb, ZeroWeightMicrobatch)]


def _zero_weight(accelerator: Any) -> contextlib.AbstractContextManager:
    """Within the block ``accelerator.backward`` scales the loss by 0 first: a gradient of exact zeros, through the
    same forward and backward collectives."""
    return _scaled_backward(accelerator, 0.0)


@contextlib.contextmanager
def _scaled_backward(accelerator: Any, weight: float) -> Iterator[None]:
    """Within the block ``accelerator.backward`` scales the loss by ``weight`` first, whatever computed it (the
    Trainer's step hands every loss to it)."""
    own = "backward" in vars(accelerator)
    backward = accelerator.backward

    def weighted_backward(loss: torch.Tensor, **kwargs: Any) -> Any:
        return backward(loss * weight, **kwargs)

    accelerator.backward = weighted_backward
    try:
        yield
    finally:
        if own:
            accelerator.backward = backward
        else:
            del accelerator.backward
