"""ODC for the transformers `Trainer`: `ODCTrainerMixin` and `ODCCallback`.

Use as ``class MyTrainer(ODCTrainerMixin, Trainer)`` (or on top of a TRL trainer, see `odc_accelerate.integrations.trl`).
What the mixin changes, and why:

* **Accelerator.** The Trainer has no argument for a plugin, so the mixin builds an `ODCPlugin` (FSDP2 + ODC engine)
  from the training arguments and the launch's FSDP settings, and refuses FSDP1, DDP or no FSDP with one error.
* **One dataloader item = this rank's whole optimizer step.** A `LengthBalancedBatchSampler` plans every step over
  all ranks (``samples_per_step = per_device_train_batch_size x gradient_accumulation_steps x world_size`` unless set),
  and each rank gets its own list of microbatches, so ranks may run different numbers of microbatches. The
  Trainer's gradient accumulation would count microbatches globally and deadlock, so it runs with
  ``gradient_accumulation_steps=1`` and ``training_step`` loops the microbatches itself; the effective batch is
  unchanged. accelerate's re-sharding of the dataloader is bypassed (the sampler is already rank-aware). With a
  padded collator the plan is made on padded shapes (`odc_accelerate.padded`). As in the Trainer's own loop, every
  microbatch but a rank's last runs under ``accelerator.no_sync``: gradients accumulate locally and are reduced (ODC:
  scatter-added) once per step, unless accelerate's ``sync_each_batch`` asks for every microbatch.
* **Exact loss.** ``num_items_in_batch`` is the number of label tokens of the whole step over all ranks (one
  all-reduce at the step start, before any microbatch); every microbatch's summed token loss is divided by it and
  multiplied by the world size (the Trainer's ``average_tokens_across_devices`` scaling), which is
  `odc_accelerate.loss_scale`: the loss equals one process's per-token mean over the global batch.
* **No collective inside a step.** ``accelerator.gather_for_metrics`` calls made during the microbatches (TRL makes
  several per microbatch) are answered locally and recorded; one all-reduce at the step boundary produces the global
  values (see `ODCTrainerMixin._odc_finalize_metrics`).
* **Step boundary.** ``engine.pre_optimizer_step()`` runs at the end of ``training_step``, so the Trainer's grad-norm
  and clipping see the final gradients; `ODCCallback.on_optimizer_step` calls ``engine.post_optimizer_step()``.
* **Metrics** (logged with the loss, so they land in ``trainer_state.json``'s ``log_history``): ``odc/tokens_per_s``
  (non-padding input tokens of all ranks per second of wall time), ``odc/microbatches_min|max``, per-rank
  ``odc/busy_s_rank<r>`` and ``odc/wait_s_rank<r>`` (wait = time in ODC's step-boundary barriers; busy = step time
  - wait), ``odc/bubble_pct`` = 100 x (1 - mean busy / step time). Values are per logging interval (sums of seconds).
  Plain FSDP2 runs through this mixin log the same keys (wait = 0 unless ``ODC_TIME_COLLECTIVES=1`` times FSDP2's
  collectives, see `odc_accelerate.telemetry`), so that the end-to-end benchmark compares like with like.
* **Checkpoints.** After the Trainer loads weights, ``engine.republish()`` makes peers read the loaded shards. The
  sampler is deterministic (seed, epoch, step), so skipping the trained steps resumes the exact data order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import TrainerCallback

from .. import _transformers_compat as tcompat
from .accelerate import ODCPlugin, _parse_bool, get_engine, validate_odc_options

logger = logging.getLogger(__name__)

__all__ = ["ODCCallback", "ODCOptions", "ODCTrainerMixin", "resolve_odc_options"]


@dataclass
class ODCOptions:
    """ODC settings of one Trainer, resolved from the training arguments, their ``fsdp_config`` and the environment.

    Attributes:
        odc (`bool`): attach the ODC engine.
        balanced (`bool`): use the rank-aware `LengthBalancedBatchSampler` step loop (always with ODC; without ODC when
            a balance mode was asked for explicitly, e.g. to compare plain FSDP2 on the same microbatches).
        balance (`str`): ``"odc"`` or ``"lockstep"``.
        transport (`str`), timeout (`float`), max_tokens_per_microbatch (`int` or None), samples_per_step (`int` or None).
        source (`str`): where ODC was switched on (``"args"``, ``"fsdp_config"``, ``"env"`` or ``"off"``).
    """

    odc: bool = False
    balanced: bool = False
    balance: str = "odc"
    transport: str = "auto"
    timeout: float = 600.0
    max_tokens_per_microbatch: int | None = None
    samples_per_step: int | None = None
    source: str = "off"


_KEYS = ("transport", "timeout", "max_tokens_per_microbatch", "balance", "samples_per_step")


def resolve_odc_options(args: Any) -> ODCOptions:
    """Resolve ODC settings: explicit ``args.odc*`` fields, then an ``odc`` section of ``args.fsdp_config``, then
    ``ODC_*`` environment variables (exported by ``odc-accelerate launch`` from the accelerate config file).

    The ``fsdp_config`` section may be ``"odc": true`` or ``"odc": {"enable": true, "transport": "shm", ...}``, and
    flat ``odc_<key>`` entries are read too (``--fsdp_config file.json``; TrainingArguments keeps unknown keys).
    """
    found: dict[str, Any] = {}
    source = "off"
    fsdp_config = getattr(args, "fsdp_config", None) or {}
    if isinstance(fsdp_config, str):
        # TrainingArguments only loads --fsdp_config when --fsdp is set; the ODC section counts either way.
        import json

        with open(fsdp_config, encoding="utf-8") as f:
            fsdp_config = json.load(f)
    section = fsdp_config.get("odc") if isinstance(fsdp_config, dict) else None
    if isinstance(section, dict):
        found.update({k: v for k, v in section.items() if k != "enable"})
        if "enable" in section:
            found["odc"] = _parse_bool(section["enable"], "fsdp_config.odc.enable")
    elif section is not None:
        found["odc"] = _parse_bool(section, "fsdp_config.odc")
    if isinstance(fsdp_config, dict):
        for key in _KEYS:
            if f"odc_{key}" in fsdp_config:
                found[key] = fsdp_config[f"odc_{key}"]
    if found.get("odc"):
        source = "fsdp_config"

    for key in ("odc",) + _KEYS:  # explicit training arguments win
        value = getattr(args, "odc" if key == "odc" else f"odc_{key}", None)
        if value is not None:
            found[key] = value
            if key == "odc" and value:
                source = "args"

    env = os.environ
    if "odc" not in found and env.get("ODC_ENABLE"):
        found["odc"] = _parse_bool(env["ODC_ENABLE"], "ODC_ENABLE")
        source = "env" if found["odc"] else source
    for key, name in (
        ("transport", "ODC_TRANSPORT"),
        ("timeout", "ODC_TIMEOUT"),
        ("max_tokens_per_microbatch", "ODC_MAX_TOKENS_PER_MICROBATCH"),
        ("balance", "ODC_BALANCE"),
        ("samples_per_step", "ODC_SAMPLES_PER_STEP"),
    ):
        if key not in found and env.get(name):
            found[key] = env[name]

    odc = bool(found.get("odc", False))
    opts = ODCOptions(
        odc=odc,
        balanced=odc or found.get("balance") is not None,
        balance=str(found.get("balance") or "odc"),
        transport=str(found.get("transport") or "auto"),
        timeout=float(found["timeout"]) if found.get("timeout") is not None else 600.0,
        max_tokens_per_microbatch=int(found["max_tokens_per_microbatch"])
        if found.get("max_tokens_per_microbatch") is not None
        else None,
        samples_per_step=int(found["samples_per_step"]) if found.get("samples_per_step") is not None else None,
        source=source if odc else "off",
    )
    validate_odc_options(opts.transport, opts.timeout, opts.max_tokens_per_microbatch, opts.balance, "ODC config")
    return opts


class ODCCallback(TrainerCallback):
    """Closes each ODC step after the optimizer (``engine.post_optimizer_step()`` and the step's timing), and the
    collective timer of a timed plain-FSDP2 run when training ends.

    Callbacks do not receive the trainer, so the mixin constructs this with itself.
    """

    def __init__(self, trainer: ODCTrainerMixin) -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._odc_after_optimizer_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Put torch.distributed's functions and FSDP2's comms back: saving or evaluating after training runs untimed.
        timer, self.trainer._odc_timer = self.trainer._odc_timer, None
        if timer is not None:
            timer.close()


class _DeferredGather:
    """Stands in for ``accelerator.gather`` / ``gather_for_metrics`` during microbatches: answers with the local value.

    A gather of a tensor returns ``[world * n, ...]`` rows; answering with this rank's rows only keeps shapes valid for
    sums, means and ratios. For every tensor that goes through, the sum and the element count are recorded per call
    position, so that one all-reduce at the step boundary gives global sums and means over the whole step.
    """

    def __init__(self) -> None:
        self.calls: list[list[tuple[float, float]]] = []  # per microbatch: (sum, count) of each gathered tensor
        self.current: list[tuple[float, float]] | None = None

    def start_microbatch(self) -> None:
        self.current = []
        self.calls.append(self.current)

    def __call__(self, input_data: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(input_data, torch.Tensor):
            if self.current is not None:
                self.current.append((float(input_data.detach().double().sum()), float(input_data.numel())))
            return input_data.reshape(1) if input_data.dim() == 0 else input_data
        if isinstance(input_data, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in input_data):
            return type(input_data)(self(t) for t in input_data)
        return input_data  # objects: this rank's own, like a one-process gather


class ODCTrainerMixin:
    """Mixin that runs a `transformers.Trainer` (or TRL trainer) with ODC; put it first in the bases.

    ODC settings come from the training arguments' ``odc`` / ``odc_*`` fields (see
    `odc_accelerate.integrations.trl.ODCSFTConfig`), an ``odc`` section of ``fsdp_config``, or ``ODC_*`` environment
    variables, in that order (see `resolve_odc_options`). The launch must be FSDP2 (an accelerate config with
    ``distributed_type: FSDP`` and ``fsdp_version: 2``); on CPU it runs with gloo and shared memory.

    Attributes:
        odc_options (`ODCOptions`): the resolved settings.
        odc_engine (`ODCEngine` or `None`): the engine, once the model is prepared.
        odc_record_dist_calls (`bool`): count torch.distributed calls made during microbatches (tests); the counts
            per step are in ``odc_microbatch_dist_calls``.
    """

    odc_record_dist_calls: bool = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        tcompat.check()
        tcompat.passthrough_skip_first_batches()
        self._odc_sampler = None
        self._odc_pending: list[dict[str, float]] = []
        self._odc_step: dict[str, float] = {}
        self._odc_timer: Any = None  # telemetry.CollectiveTimer on timed plain-FSDP2 runs
        self._odc_trace: Any = None  # telemetry.StepTrace when ODC_TRACE_DIR is set
        self._odc_looping = False  # inside the balanced step's microbatch loop (loss scaling of subclasses)
        self._odc_gathers_per_microbatch = 0  # agreed over ranks at the last step boundary
        self.odc_microbatch_dist_calls: list[dict[str, int]] = []
        super().__init__(*args, **kwargs)
        self.add_callback(ODCCallback(self))

    # ------------------------------------------------------------------ accelerator
    def create_accelerator_and_postprocess(self) -> None:
        self.odc_options = resolve_odc_options(self.args)
        opts = self.odc_options
        if opts.balanced:
            world = max(1, int(getattr(self.args, "world_size", 1)))
            ga = int(self.args.gradient_accumulation_steps)
            if opts.samples_per_step is None:
                opts.samples_per_step = int(self.args.per_device_train_batch_size) * ga * world
            if ga != 1:
                # Ranks may run different numbers of microbatches: the Trainer's accumulation counts them globally,
                # so one dataloader item holds this rank's whole step instead (the effective batch is unchanged).
                logger.info(
                    "ODC: gradient_accumulation_steps=%d folded into samples_per_step=%d; the Trainer runs 1 "
                    "accumulation step per optimizer step.",
                    ga,
                    opts.samples_per_step,
                )
                self.args.gradient_accumulation_steps = 1
        super().create_accelerator_and_postprocess()
        if opts.odc:
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
        opts = self.odc_options
        if opts.odc:
            from .. import _accelerate_compat as acompat

            plugin_args = dict(getattr(self.args, "fsdp_plugin_args", None) or {})
            launched_fsdp = acompat.env_true("ACCELERATE_USE_FSDP")
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
            kwargs["fsdp_plugin"] = ODCPlugin(
                fsdp_version=2,
                odc=True,
                transport=opts.transport,
                timeout=opts.timeout,
                max_tokens_per_microbatch=opts.max_tokens_per_microbatch,
                balance=opts.balance,
                **plugin_args,
            )
        return super()._build_accelerator_args(**kwargs)

    @property
    def odc_engine(self) -> Any:
        accelerator = getattr(self, "accelerator", None)
        return get_engine(accelerator) if accelerator is not None else None

    # ------------------------------------------------------------------ data
    def _odc_lengths(self, dataset: Any) -> Any:
        from ..sampler import dataset_lengths

        return dataset_lengths(dataset)

    def _odc_padded(self) -> bool:
        """Whether the collator pads every row of a microbatch to its longest sample; plans then count padded shapes.

        Not padded: TRL's ``padding_free`` (also set by its BFD packing) and transformers' `DataCollatorWithFlattening`.
        """
        from transformers import DataCollatorWithFlattening

        padding_free = getattr(self, "padding_free", getattr(self.args, "padding_free", False))
        return not padding_free and not isinstance(self.data_collator, DataCollatorWithFlattening)

    def _odc_budget(self, lengths: Any) -> int:
        opts = self.odc_options
        budget = opts.max_tokens_per_microbatch
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
        return int(budget)

    def get_train_dataloader(self) -> DataLoader:
        if not self.odc_options.balanced:
            return super().get_train_dataloader()
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        from ..sampler import LengthBalancedBatchSampler

        dataset = self._remove_unused_columns(self.train_dataset, description="training")
        lengths = self._odc_lengths(dataset)
        opts = self.odc_options
        opts.max_tokens_per_microbatch = self._odc_budget(lengths)
        world = max(1, int(self.args.world_size))
        self._odc_sampler = LengthBalancedBatchSampler(
            lengths,
            world_size=world,
            rank=int(self.args.process_index),
            samples_per_step=int(opts.samples_per_step),
            max_tokens_per_microbatch=opts.max_tokens_per_microbatch,
            mode=opts.balance,
            shuffle=True,
            seed=int(self.args.data_seed if self.args.data_seed is not None else self.args.seed),
            drop_last=True,
            padded=self._odc_padded(),
        )
        # batch_size=None: each sampler item (this rank's microbatch index lists) is fetched and collated as one item.
        # Not passed through accelerator.prepare: its re-sharding would split an already rank-aware plan.
        return _StepDataLoader(
            _StepDataset(dataset),
            sampler=self._odc_sampler,
            batch_size=None,
            collate_fn=_StepCollator(self.data_collator),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    def _run_epoch(self, **kwargs: Any) -> Any:
        sampler = self._odc_sampler
        if sampler is not None and isinstance(kwargs.get("train_dataloader"), _StepDataLoader):
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
        self._odc_step = {"start": time.perf_counter()}
        if not self.odc_options.balanced:
            # The Trainer's own microbatching: timed the same way, so plain runs log comparable step figures.
            batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
            self._odc_step.update(microbatches=len(batches), tokens=sum(_input_tokens(b) for b in batches))
            self._odc_start_collective_timer()
            self._odc_trace_shapes(batches)
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
        local = self._odc_num_items(microbatches)
        tokens = sum(_input_tokens(mb) for mb in microbatches)
        counts = torch.tensor([local], dtype=torch.float64, device=device)
        if self.accelerator.num_processes > 1:
            # The one collective of the step before its microbatches: the global count of loss items.
            counts = self.accelerator.reduce(counts, reduction="sum")
        self._odc_step.update(microbatches=len(microbatches), tokens=tokens)
        self._odc_start_collective_timer()  # plain FSDP2 on the lockstep plan (a no-op with ODC)
        self._odc_trace_shapes(microbatches)
        num_items = torch.tensor(int(counts[0]), device=device)
        return [microbatches], num_items

    def _odc_num_items(self, microbatches: list[Any]) -> int:
        """What this rank's loss of the step is normalised over: label tokens (a token-mean loss). The DPO trainer
        counts pairs instead."""
        return sum(tcompat.count_label_tokens(self, mb) for mb in microbatches)

    def _odc_start_collective_timer(self) -> None:
        """On plain FSDP2 runs with ``ODC_TIME_COLLECTIVES=1`` (the end-to-end benchmark), time FSDP2's collectives so
        that per-rank wait is reported as it is for ODC (see `odc_accelerate.telemetry`)."""
        if self._odc_timer is not None or self.odc_engine is not None:
            return
        if os.environ.get("ODC_TIME_COLLECTIVES", "0") != "1":
            return
        from .. import _fsdp_compat
        from ..telemetry import CollectiveTimer

        if _fsdp_compat.is_fsdp2(self.model):
            self._odc_timer = CollectiveTimer(self.model)

    def _odc_trace_shapes(self, microbatches: list[Any]) -> None:
        """With ``ODC_TRACE_DIR`` set, remember the step's microbatch shapes for `telemetry.StepTrace`."""
        if self._odc_trace is None:
            from ..telemetry import StepTrace

            self._odc_trace = StepTrace.from_env(self.accelerator.process_index) or False
        if self._odc_trace:
            from ..telemetry import microbatch_shape

            self._odc_step["shapes"] = [microbatch_shape(mb) for mb in microbatches]

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        if not isinstance(inputs, list):
            return super().training_step(model, inputs, num_items_in_batch)
        engine = self.odc_engine
        deferred = _DeferredGather()
        real_gathers = self.accelerator.gather_for_metrics, self.accelerator.gather
        total = torch.zeros((), device=self.args.device)
        self.accelerator.gather_for_metrics = deferred  # type: ignore[method-assign]
        self.accelerator.gather = deferred  # type: ignore[method-assign]
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
                with contextlib.nullcontext() if sync else self.accelerator.no_sync(model=model):
                    if self.odc_record_dist_calls:
                        from ..testing.dist_counter import count_dist_calls

                        with count_dist_calls() as counts:
                            total += super().training_step(model, mb, num_items_in_batch)
                        self.odc_microbatch_dist_calls.append(dict(counts))
                    else:
                        total += super().training_step(model, mb, num_items_in_batch)
        finally:
            self._odc_looping = False
            self.accelerator.gather_for_metrics, self.accelerator.gather = real_gathers  # type: ignore[method-assign]
        self._odc_step["compute_end"] = time.perf_counter()
        self._odc_reduce_metrics(deferred)
        if engine is not None:
            engine.pre_optimizer_step()  # before the Trainer's grad-norm / clipping
        return total

    _ODC_MAX_GATHERS = 32  # per microbatch; fixed, since a rank with no microbatch must join the same all-reduce

    def _odc_reduce_metrics(self, deferred: _DeferredGather) -> None:
        slots = self._ODC_MAX_GATHERS
        width = max((len(c) for c in deferred.calls), default=0)
        if width > slots:
            raise RuntimeError(f"ODC defers at most {slots} metric gathers per microbatch, got {width}.")
        uneven = any(len(c) != width for c in deferred.calls)
        # [sums per call position | element counts per call position | microbatches | uneven | width | width^2 |
        #  has work]: equal widths on all ranks with work iff (sum w)^2 == n * sum w^2, decided alike on every rank
        local = torch.zeros(2 * slots + 5, dtype=torch.float64)
        if not uneven:
            for c in deferred.calls:
                local[:width] += torch.tensor([v for v, _ in c], dtype=torch.float64)
                local[slots : slots + width] += torch.tensor([n for _, n in c], dtype=torch.float64)
        local[2 * slots] = len(deferred.calls)
        local[2 * slots + 1] = float(uneven)
        local[2 * slots + 2] = float(width)
        local[2 * slots + 3] = float(width * width)
        local[2 * slots + 4] = float(bool(deferred.calls))
        total = local.to(self.args.device)
        if self.accelerator.num_processes > 1:
            total = self.accelerator.reduce(total, reduction="sum")
        total = total.cpu()
        width_sum, width_sq, ranks_with_work = (float(v) for v in total[2 * slots + 2 :])
        if float(total[2 * slots + 1]) > 0 or width_sum * width_sum != ranks_with_work * width_sq:
            logger.warning("ODC: microbatches made different numbers of metric gathers; their metrics are local.")
            return
        self._odc_gathers_per_microbatch = round(width_sum / ranks_with_work) if ranks_with_work else 0
        self._odc_finalize_metrics(
            local[:slots].tolist(),
            total[:slots].tolist(),
            len(deferred.calls),
            int(total[2 * slots]),
            global_counts=total[slots : 2 * slots].tolist(),
        )

    def _odc_finalize_metrics(
        self,
        local_sums: list[float],
        global_sums: list[float],
        local_microbatches: int,
        global_microbatches: int,
        global_counts: list[float] | None = None,
    ) -> None:
        """Replace what the trainer recorded from locally answered metric gathers with global values.

        ``local_sums[i]`` / ``global_sums[i]`` are the sums over this rank's / all ranks' microbatches of the tensor
        passed to the i-th ``gather`` / ``gather_for_metrics`` call of a microbatch, ``global_counts[i]`` its number
        of elements over all ranks (so that ``global_sums[i] / global_counts[i]`` is a mean over the whole step).
        Trainer subclasses know what their gathers mean (see the TRL trainers); the base Trainer makes none during
        microbatches.
        """

    def _odc_after_optimizer_step(self) -> None:
        engine = self.odc_engine
        if engine is not None:
            engine.post_optimizer_step()
        if "start" not in self._odc_step:
            return
        end = time.perf_counter()
        step_s = end - self._odc_step["start"]
        if engine is not None:
            stats = engine.last_step_stats
            wait = float(stats.wait_s) if stats is not None else 0.0
        else:
            wait = self._odc_timer.take() if self._odc_timer is not None else 0.0
        self._odc_pending.append(
            {
                "step_s": step_s,
                "wait_s": wait,
                "busy_s": step_s - wait,
                "microbatches": float(self._odc_step.get("microbatches", 0)),
                "tokens": float(self._odc_step.get("tokens", 0.0)),
            }
        )
        if self._odc_trace:
            self._odc_trace.record(self._odc_step.get("shapes", []), step_s, step_s - wait, wait)
        self._odc_step = {}

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self._odc_pending and "loss" in logs:
            logs.update(self._odc_interval_metrics())
        super().log(logs, *args, **kwargs)

    def _odc_interval_metrics(self) -> dict[str, float]:
        pending, self._odc_pending = self._odc_pending, []
        keys = ("step_s", "busy_s", "wait_s")
        local = [sum(p[k] for p in pending) for k in keys]
        mbs = [p["microbatches"] for p in pending]
        tokens = sum(p["tokens"] for p in pending)
        row = torch.tensor(local + [min(mbs), max(mbs), tokens], dtype=torch.float64, device=self.args.device)
        rows = row[None]
        if self.accelerator.num_processes > 1:
            rows = self.accelerator.gather(row[None])  # step boundary: one gather per logged interval
        rows = rows.reshape(-1, row.numel()).cpu()
        step_s = float(rows[:, 0].max())
        tokens = float(rows[:, 5].sum())  # input tokens of every rank
        out: dict[str, float] = {
            "odc/tokens_per_s": round(tokens / step_s, 1) if step_s > 0 else 0.0,
            "odc/step_s": round(step_s / len(pending), 4),
            "odc/microbatches_min": int(rows[:, 3].min()),
            "odc/microbatches_max": int(rows[:, 4].max()),
            "odc/bubble_pct": round(100.0 * (1.0 - float(rows[:, 1].mean()) / step_s), 2) if step_s > 0 else 0.0,
        }
        for r in range(rows.shape[0]):
            out[f"odc/busy_s_rank{r}"] = round(float(rows[r, 1]), 4)
            out[f"odc/wait_s_rank{r}"] = round(float(rows[r, 2]), 4)
        return out

    def _track_num_input_tokens(self, inputs: Any) -> None:
        if isinstance(inputs, list):
            inputs = _merge_for_counting(inputs, getattr(self.model, "main_input_name", "input_ids"))
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


class _StepDataLoader(DataLoader):
    """A DataLoader whose items are whole steps; it skips on resume through its sampler (see `_run_epoch`)."""

    _odc_skips_itself = True


class _StepDataset(torch.utils.data.Dataset):
    """Fetches a whole step: ``dataset[[[i, j], [k]]]`` -> ``[[row_i, row_j], [row_k]]``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, microbatches: list[list[int]]) -> list[list[Any]]:
        return [[self.dataset[i] for i in mb] for mb in microbatches]


class _StepCollator:
    def __init__(self, collator: Any) -> None:
        self.collator = collator

    def __call__(self, step: list[list[Any]]) -> list[Any]:
        return [self.collator(features) for features in step if features]


def _input_tokens(batch: dict) -> int:
    if "attention_mask" in batch and batch["attention_mask"] is not None:
        return int(batch["attention_mask"].sum())
    if "position_ids" in batch:
        return int(batch["position_ids"].numel())
    ids = batch.get("input_ids")
    return int(ids.numel()) if ids is not None else 0


def _merge_for_counting(microbatches: list[dict], main: str) -> dict:
    if not microbatches:
        return {main: torch.zeros(0, dtype=torch.long)}
    out = {main: torch.cat([mb[main].reshape(-1) for mb in microbatches])}
    if all("attention_mask" in mb for mb in microbatches):
        out["attention_mask"] = torch.cat([mb["attention_mask"].reshape(-1) for mb in microbatches])
    return out
