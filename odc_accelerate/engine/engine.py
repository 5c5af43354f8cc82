"""ODCEngine: FSDP2 with one-sided gathers and scatter-accumulates, synchronised once per optimizer step.

Data path, per FSDP2 param group (one per ``fully_shard`` call):

* every rank publishes its shard (FSDP2's all-gather input, already in ``param_dtype``) into a
  transport buffer ``p<i>`` after each optimizer step;
* FSDP2's all-gather hook fills the peers' rows of the gather output by reading their ``p<i>``;
* FSDP2's reduce-scatter hook adds row ``r`` of its input into owner ``r``'s accumulator ``g<i>``
  and returns zeros, so FSDP2's own per-microbatch post-processing adds nothing to ``.grad``;
* ``pre_optimizer_step`` waits for every rank (one barrier), then folds the accumulator into
  ``.grad`` with FSDP2's exact post-processing (divisor, dtype cast, per-param split, ``+=``).

The step memory policy (`odc_accelerate.engine.memory`) decides, per group and per rank, whether the gathered parameters
stay through the step (gathered once; dropped in ``pre_optimizer_step``) and whether unsharded gradients stay until
``pre_optimizer_step`` (reduced once, just before the barrier) instead of being scatter-added after every microbatch.

Between ``post_optimizer_step`` and ``pre_optimizer_step`` the engine makes no torch.distributed
call and waits for no peer, so ranks may run different numbers of microbatches, including zero.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .._compat import fsdp as compat
from .._compat import warn_if_untested
from ..transport import BufferSpec, ODCTimeoutError, Transport, create_transport
from ..transport.base import is_out_of_memory
from ..transport.claims import claim_counter, claim_indices
from . import hsdp, memory, model_check, process_exit

logger = logging.getLogger(__name__)


class EngineState(enum.Enum):
    """Where an `ODCEngine` is in the optimizer-step cycle."""

    IN_STEP = "in_step"  # microbatches run: hooks gather and scatter-accumulate
    IN_OPTIMIZER = "in_optimizer"  # gradients folded (pre_optimizer_step); the optimizer may run, then publish
    CLOSED = "closed"  # FSDP2's own collectives restored; also the state while __init__ builds the engine
    BROKEN = "broken"  # a barrier failed or set-up raised: the step is lost, only close() is allowed


@dataclass
class StepStats:
    """What one optimizer step cost this rank (seconds unless named otherwise).

    Attributes:
        gather_s: time inside all-gather hooks (reading peers' shards).
        scatter_s: time inside reduce-scatter hooks (adding slices into owners' accumulators).
        wait_s: time blocked in barriers: the step boundary's (and every hook's with ``sync_every_hook``).
        fold_s: time folding the accumulators into ``.grad``.
        publish_s: time publishing the new shards after the optimizer step.
        flush_s: time waiting, before a barrier, for this rank's own queued device work (its backward, adds and
            publishes; GPU transports only). Busy, not wait: ``wait_s`` is time blocked on peers only.
        replicate_s: HSDP only: time in the step's all-reduce across replicas (packing and waiting; folding excluded).
            Counted in ``wait_s`` too: a rank there is blocked on its replicas.
        replicate_bytes: HSDP only: bytes this rank's step all-reduced across replicas.
        gathers / scatters: hook calls during the step.
        bytes_read / bytes_accumulated: payload moved through the transport.
        transport_bytes: device memory the transport holds (``Transport.memory_report()["total"]``; 0 on CPU).
        peak_memory_bytes: this rank's peak memory up to the end of the step (GPU: torch's ``max_memory_allocated``;
            CPU: the process's peak resident set size, shared memory mapped from peers included). Not reset by the
            engine, which would change what other readers of these figures see: reset them to measure one step.
        kept_params / kept_grads: param groups whose gathered params / unsharded grads the memory policy kept.
    """

    gather_s: float = 0.0
    scatter_s: float = 0.0
    wait_s: float = 0.0
    fold_s: float = 0.0
    publish_s: float = 0.0
    gathers: int = 0
    scatters: int = 0
    bytes_read: int = 0
    bytes_accumulated: int = 0
    flush_s: float = 0.0
    transport_bytes: int = 0
    replicate_s: float = 0.0
    replicate_bytes: int = 0
    peak_memory_bytes: int = 0
    kept_params: int = 0
    kept_grads: int = 0


@dataclass
class _Group:
    """One FSDP2 param group as the engine sees it."""

    index: int
    fqn: str
    group: Any  # FSDPParamGroup
    module: nn.Module
    gather_numel: int
    gather_dtype: torch.dtype
    reduce_numel: int
    reduce_dtype: torch.dtype | None
    saved_comms: tuple[Any, Any]
    saved_flags: tuple[bool, bool]
    touched: bool = False
    saved_keep: Any = None  # compat.KeepFlags: the user's FSDP2 switches that the memory policy changes
    keep: tuple[bool, bool] = (False, False)  # (gathered params, unsharded grads) kept through the step


class _ODCAllGather(compat.AllGather):
    """FSDP2 all-gather hook: fill the peers' rows of the output from their published shards."""

    def __init__(self, engine: ODCEngine, index: int) -> None:
        self._engine, self._index = engine, index

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False):
        self._engine._gather(self._index, output_tensor)
        return None


class _ODCReduceScatter(compat.ReduceScatter):
    """FSDP2 reduce-scatter hook: add each owner's slice into its accumulator, return zeros."""

    def __init__(self, engine: ODCEngine, index: int) -> None:
        self._engine, self._index = engine, index

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # FSDP2 may turn the output into `.grad` (a view): it must be fresh memory every call.
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ):
        self._engine._scatter_accumulate(self._index, input_tensor, output_tensor, op)
        return None


class _ODCReduceScatterHSDP(_ODCReduceScatter):
    """The reduce-scatter hook on an HSDP mesh: FSDP2's per-microbatch all-reduce across replicas is switched off
    (the engine all-reduces once per step)."""

    odc_defers_all_reduce = True


def _out_of_memory(err: BaseException, device: torch.device, what: str, detail: str, advice: str) -> RuntimeError:
    """The refusal for a CUDA out-of-memory error ``err`` met on this rank in the engine's set-up (caused by ``err``).

    Its text names this rank by its global rank: peers that raise it too (`model_check.agree_on_model`) say who ran
    short. Free memory is read after torch's cache is released, as the transport's check reads it; a device other than
    CUDA has no such reading.
    """
    free = memory.free_and_total(device, release_cache=True)[0] if device.type == "cuda" else None
    text = memory.out_of_memory_text(
        f"rank {dist.get_rank()}", what, free=free, detail=detail, ran_out="it ran out of GPU memory", advice=advice
    )
    refusal = RuntimeError(text)
    refusal.__cause__ = err
    return refusal


def _model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


class ODCEngine:
    """Turn an FSDP2 model into an ODC model: per-layer one-sided communication, one sync per step.

    Collective: every rank of the FSDP2 mesh constructs it, with the same model structure.

    Args:
        model (`torch.nn.Module`):
            The ROOT module returned by ``fully_shard``, with every block already wrapped. One param
            group per ``fully_shard`` call, ``reshard_after_forward`` a bool, and a 1-D mesh or a 2-D
            (replicate, shard) HSDP mesh covering every rank of the job. On an HSDP mesh ODC runs within each shard
            group, which must be on one host, and the gradient shards are all-reduced across replicas once per step
            in ``pre_optimizer_step`` (see `odc_accelerate.engine.hsdp`).
        transport (`str` or `Transport`, *optional*, defaults to `"auto"`):
            ``"auto"`` (shared memory for CPU tensors), ``"shm"``, or a :class:`~odc_accelerate.transport.Transport`.
        timeout (`float`, *optional*, defaults to 600.0):
            Seconds any wait may last; a missing or dead rank raises
            :class:`~odc_accelerate.ODCTimeoutError` naming it.
        sync_every_hook (`bool`, *optional*, defaults to `False`):
            Benchmark-only: add a barrier inside every hook (per-layer sync like FSDP2, same data path),
            to isolate what once-per-step sync buys. Requires equal microbatch counts on every rank.
        frozen (`bool`, *optional*, defaults to `False`):
            Gather-only mode for a model that is never trained, e.g. DPO's reference model: no parameter may
            require grad, no accumulator is allocated, the shards are published once here, and forwards read
            them with no synchronisation at all (there is no optimizer step to call). After changing the
            weights (e.g. syncing a reference model), call `republish` on every rank.
        replicate_bucket_bytes (`int`, *optional*, defaults to 64 MiB):
            HSDP only: bucket size of the once-per-step all-reduce across replicas.
        memory_policy (`str` or `dict`, *optional*, defaults to `"neither"`):
            What this rank keeps unsharded through a step, per param group: ``"params"`` (gather once per step),
            ``"grads"`` (reduce once per step, at `pre_optimizer_step`), ``"both"``, ``"neither"`` (memory bounded by
            the shard, the accumulator and one microbatch, as FSDP2 reducing every microbatch), ``"auto"`` (from this
            rank's free memory, re-chosen after every optimizer step), or ``pattern=choice`` pairs / a dict matched
            against group FQNs (see `odc_accelerate.engine.memory`). The result equals ``"neither"`` up to summation order.
            A frozen engine keeps gathered params until `republish`.
        memory_headroom (`str` or `float`, *optional*, defaults to `"30%"`):
            What ``"auto"`` leaves free for activations and the optimizer: a percentage of this rank's memory
            (``"30%"``) or a size (``"4GiB"``; a number is bytes).

    Example:

    ```python
    engine = ODCEngine(model)
    for step in range(n):
        for mb in my_microbatches:  # the count may differ per rank, including zero
            loss = compute(model, mb)
            loss.backward()
        engine.pre_optimizer_step(optimizer)  # .grad now equals FSDP2's for the same total work
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        engine.post_optimizer_step()  # new shards published
    engine.close()
    ```

    Gradients of a step are the sum of every rank's contributions divided as FSDP2 divides them (by
    the world size unless ``set_gradient_divide_factor`` was used). A rank that ran zero microbatches
    still receives its shards' gradients from the ranks that did. A param group no rank ran backward
    through in a step keeps its ``.grad`` untouched (None after ``zero_grad``), as with FSDP2; if no
    rank ran any microbatch, no gradient is created and the optimizer skips the parameters.
    """

    def __init__(
        self,
        model: nn.Module,
        transport: str | Transport = "auto",
        timeout: float = 600.0,
        *,
        sync_every_hook: bool = False,
        frozen: bool = False,
        replicate_bucket_bytes: int = hsdp.DEFAULT_BUCKET_BYTES,
        memory_policy: str | Mapping[str, str] = memory.DEFAULT_POLICY,
        memory_headroom: str | float = memory.DEFAULT_HEADROOM,
    ) -> None:
        self._state = EngineState.CLOSED  # until fully built, close() has nothing to undo
        self._groups: list[_Group] = []
        self.transport: Transport | None = None
        self._replicas: hsdp.ReplicaReducer | None = None
        # Checked before any collective: the same bad value raises on every rank.
        self._policy = memory.parse_policy(memory_policy)
        self._headroom = memory.parse_headroom(memory_headroom)
        self.memory_policy = memory_policy
        if sync_every_hook and self._policy != [("*", "neither")]:
            raise ValueError(
                "sync_every_hook (a benchmark arm with a barrier in every hook) needs every rank to gather and reduce "
                f"in lockstep: use memory_policy='neither' with it, not {memory_policy!r}"
            )
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not compat.is_fsdp2(model):
            raise TypeError(
                f"ODCEngine needs a model wrapped with FSDP2 (torch.distributed.fsdp.fully_shard), got "
                f"{type(model).__name__}. Call fully_shard on each block and then on the root; FSDP1 "
                "(FullyShardedDataParallel) and DDP are not supported."
            )
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ODCEngine needs torch.distributed to be initialised (init_process_group) first")
        warn_if_untested("torch", "The FSDP2 internals it reads may behave differently there.")
        # This rank's out-of-memory refusal met before the ranks agree on the model: carried into that agreement (raised
        # there on every rank), since a rank that raised alone would leave its peers waiting for it in the agreement's
        # collective until the process group's timeout.
        refusal: RuntimeError | None = None
        try:
            compat.lazy_init(model)
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            # FSDP2's own set-up (streams, buffers), before ODC allocates anything: with a GPU this full, say so
            # instead of a bare driver error.
            refusal = _out_of_memory(
                err,
                _model_device(model),
                "FSDP2's lazy initialisation",
                "its CUDA streams and buffers, made when the ODC engine starts, before ODC allocates anything",
                "Create the engine (or run the first step) with more GPU memory free: a smaller model or batch, fewer "
                "other processes on this GPU, or more GPUs to shard over",
            )
        if refusal is None:
            compat.check(model)  # FSDP2's state after its lazy init
        self.model = model
        self.timeout = float(timeout)
        self.sync_every_hook = sync_every_hook
        self.frozen = bool(frozen)
        if self.frozen:
            trainable = [n for n, p in model.named_parameters() if p.requires_grad]
            if trainable:
                raise ValueError(
                    f"ODCEngine(frozen=True) serves models that are never trained, but {len(trainable)} parameter(s) "
                    f"require grad (first: {trainable[0]}). Call model.requires_grad_(False) before fully_shard, or "
                    "use frozen=False for a trained model."
                )
        self.stats = StepStats()
        self.last_step_stats: StepStats | None = None
        self.steps = 0
        self._claims: Any = None  # the dynamic plan's counter (set with the transport)
        self._claimed_step = -1
        self._optimizer_seen: tuple[Any, bytes, list[list[str]]] | None = None  # (groups' ids, fingerprint, layout)

        entries, problem = model_check.served_groups(model)
        layouts: list[tuple[int, torch.dtype]] = []
        if refusal is None and problem is None:
            try:
                # From FSDP2's metadata, except for parameters with an all-gather extension, whose inputs are built
                # (one parameter at a time) to learn their size: that much is allocated before the transport has
                # checked its memory (see `compat.all_gather_input_layout`).
                layouts = [compat.all_gather_input_layout(group) for _, group in entries]
            except Exception as err:
                if not is_out_of_memory(err):
                    raise
                refusal = _out_of_memory(
                    err,
                    compat.group_device(entries[0][1]),
                    "the all-gather inputs of its parameters with an all-gather extension",
                    "FSDP2's fsdp_pre_all_gather, e.g. float8: built one parameter at a time to learn their sizes, "
                    "before ODC's memory check",
                    "Create the engine with more GPU memory free, or shard over more GPUs",
                )
        # Agree across ranks before raising: a rank that raised alone would leave its peers waiting in the
        # next collective.
        self._pg = compat.shard_group(entries[0][1]) if entries else None
        self.rank, self.world_size = dist.get_rank(self._pg), dist.get_world_size(self._pg)
        replicate_pg = compat.replicate_group(entries[0][1]) if entries else None
        #: replicas of each shard (1 without HSDP); the engine's ``world_size`` is the shard group's
        self.replicas = dist.get_world_size(replicate_pg) if replicate_pg is not None else 1
        if replicate_pg is not None and compat.mesh_of(entries[0][1]).size() != dist.get_world_size():
            problem = problem or (
                f"ODC with HSDP needs the (replicate, shard) mesh to cover every rank of the job, but it has "
                f"{compat.mesh_of(entries[0][1]).size()} of {dist.get_world_size()}. Build the mesh over all ranks."
            )
        # HSDP: the whole job checks together (a refusal on one replica must reach the others).
        model_check.agree_on_model(entries, refusal or problem, group=None if replicate_pg is not None else self._pg)
        self._device = compat.group_device(entries[0][1])
        if replicate_pg is not None:
            compat.check_hsdp(entries[0][1])
            name = transport if isinstance(transport, str) else getattr(transport, "name", "")
            hsdp.check_shard_group_hosts(compat.mesh_ranks(entries[0][1]), name)

        specs: dict[str, BufferSpec] = {}
        for index, ((module, group), (gather_numel, gather_dtype)) in enumerate(zip(entries, layouts, strict=True)):
            rdtype = compat.reduce_dtype(group)
            g = _Group(
                index=index,
                fqn=compat.group_fqn(group),
                group=group,
                module=module,
                gather_numel=gather_numel,
                gather_dtype=gather_dtype,
                reduce_numel=compat.reduce_scatter_numel(group),
                reduce_dtype=rdtype,
                saved_comms=compat.get_comms(group),
                saved_flags=compat.sum_and_unused_flags(group),
            )
            self._groups.append(g)
            specs[f"p{index}"] = BufferSpec(numel=g.gather_numel, dtype=g.gather_dtype)
            if rdtype is not None and not self.frozen:
                specs[f"g{index}"] = BufferSpec(numel=g.reduce_numel, dtype=rdtype, accumulated=True)
        # Exchanged at every step's barrier: per group whether this rank's backward reached it, then the fingerprint of
        # the optimizer's param groups (`pre_optimizer_step`).
        specs["touched"] = BufferSpec(numel=len(self._groups) + model_check.FINGERPRINT_BYTES, dtype=torch.uint8)

        if replicate_pg is not None and not self.frozen:
            layout = [(g.index, g.reduce_numel, g.reduce_dtype) for g in self._groups if f"g{g.index}" in specs]
            self._replicas = hsdp.ReplicaReducer(
                replicate_pg,
                layout,
                len(self._groups),
                self._device,
                self.timeout,
                bucket_bytes=replicate_bucket_bytes,
            )
        self.transport = create_transport(
            transport,
            rank=self.rank,
            world_size=self.world_size,
            timeout=self.timeout,
            device=self._device,
            group=self._pg,
        )
        try:
            self._buffers = self.transport.register(specs)
            for g in self._groups:
                # Engine owns the divisor (applied at the fold): sum-only hooks, and a known layout.
                module = g.module
                module.set_force_sum_reduction_for_comms(True)
                compat.fix_reduce_scatter_layout(module, defer_all_reduce=replicate_pg is not None)
                module.set_custom_all_gather(_ODCAllGather(self, g.index))
                if not self.frozen:
                    hook = _ODCReduceScatterHSDP if replicate_pg is not None else _ODCReduceScatter
                    module.set_custom_reduce_scatter(hook(self, g.index))
                compat.check_keep_support(g.group)
                g.saved_keep = compat.keep_flags(g.group)
            # The dynamic plan's counter: the transport's own (no communication here), or the store fallback for a
            # transport without one (one broadcast, here at set-up and never inside a step). On an HSDP mesh every
            # rank of every replica claims from one queue, beyond the shard group's transport (one host): the store.
            if self.frozen:
                self._claims = None
            elif self.replicas > 1:
                self._claims = claim_counter(None)
            else:
                self._claims = claim_counter(self.transport, self._pg)
            self._claimed_step = -1
            self._peak = memory.PeakMemory(self._device)
            self._state = EngineState.IN_OPTIMIZER  # so that the initial publish is the normal post-step path
            self._publish()
            self.steps = 0
        except BaseException as err:
            self._state = EngineState.BROKEN
            held = self.transport.memory_report().get("total", 0) if self.transport is not None else 0
            # Closing tells the peers waiting for this rank in a barrier that it will not come.
            self.close()
            if is_out_of_memory(err):
                raise _out_of_memory(
                    err,
                    self._device,
                    "ODC's set-up",
                    f"its transport holds {held / 2**20:.1f} MiB per rank, and publishing the first shards needs room "
                    "for one parameter's copy at a time",
                    "Free memory before creating the engine (load the model after it, a smaller batch), accumulate in "
                    "bf16, or shard over more GPUs",
                ) from err
            raise
        process_exit.watch(self)
        logger.info(
            "ODC engine on rank %d/%d: %d param groups%s, transport %s%s, memory policy %s: %s",
            self.rank,
            self.world_size,
            len(self._groups),
            " (frozen, gather-only)" if self.frozen else "",
            self.transport.name,
            f", HSDP: {self.replicas} replicas, {len(self._replicas.buckets)} all-reduce bucket(s) per step"
            if self._replicas is not None
            else "",
            self.memory_policy,
            self.memory_summary(),
        )

    # ------------------------------------------------------------------ hooks
    def _check_usable(self) -> None:
        if self._state in (EngineState.CLOSED, EngineState.BROKEN):
            raise RuntimeError(f"the ODCEngine is {self._state.value}; FSDP2 hooks cannot run through it any more")

    def _enter_hook(self) -> float:
        """Common start of both hooks: refuse a closed engine, optionally sync (benchmark arm), start the clock."""
        self._check_usable()
        start = time.perf_counter()
        if self.sync_every_hook:
            self._barrier()
        return start

    def _gather(self, index: int, output: torch.Tensor) -> None:
        start = self._enter_hook()
        g = self._groups[index]
        rows = output.view(self.world_size, -1)
        if rows.shape[1] != g.gather_numel or output.dtype != g.gather_dtype:
            raise RuntimeError(
                f"ODC all-gather for {g.fqn}: FSDP2 asked for {rows.shape[1]} x {output.dtype} per rank but the "
                f"published shard has {g.gather_numel} x {g.gather_dtype}; parameters were changed after ODCEngine()"
            )
        name = f"p{index}"
        for peer in range(self.world_size):
            if peer != self.rank:
                self.transport.read(peer, name, rows[peer])
        self.stats.gathers += 1
        self.stats.bytes_read += (self.world_size - 1) * g.gather_numel * output.element_size()
        self.stats.gather_s += time.perf_counter() - start

    def _scatter_accumulate(self, index: int, inp: torch.Tensor, out: torch.Tensor, op: Any) -> None:
        self._check_usable()
        if self._state != EngineState.IN_STEP:
            raise RuntimeError(
                "a backward ran after engine.pre_optimizer_step() and before engine.post_optimizer_step(); "
                "run every microbatch's backward before pre_optimizer_step()"
            )
        if op != dist.ReduceOp.SUM:
            raise RuntimeError(f"ODC expects sum reductions (the engine owns the divisor), FSDP2 passed {op}")
        start = self._enter_hook()
        g = self._groups[index]
        rows = inp.view(self.world_size, -1)
        # None: the rows have the accumulator's layout. Else (torch 2.11, some params got no gradient) where each
        # param's segment of the rows goes.
        spans = compat.reduce_scatter_spans(g.group, compat.get_comms(g.group)[1])
        expected = g.reduce_numel if spans is None else sum(numel for _, _, numel in spans)
        if rows.shape[1] != expected or inp.dtype != g.reduce_dtype:
            raise RuntimeError(
                f"ODC reduce-scatter for {g.fqn}: got {rows.shape[1]} x {inp.dtype} per rank, expected "
                f"{expected} x {g.reduce_dtype}; trainable parameters changed after ODCEngine()"
            )
        if spans is not None:
            full = rows.new_zeros(self.world_size, g.reduce_numel)  # params without a gradient add zeros
            for src, dst, numel in spans:
                full[:, dst : dst + numel] = rows[:, src : src + numel]
            rows = full
        name = f"g{index}"
        # Start with the next rank so that ranks finishing a layer together hit different owners.
        for k in range(1, self.world_size + 1):
            owner = (self.rank + k) % self.world_size
            self.transport.accumulate(owner, name, rows[owner])
        out.zero_()
        g.touched = True
        self.stats.scatters += 1
        self.stats.bytes_accumulated += inp.numel() * inp.element_size()
        self.stats.scatter_s += time.perf_counter() - start

    def _barrier(self, count_wait: bool = True) -> None:
        try:
            start = time.perf_counter()
            self.transport.flush()  # this rank's own queued work first: not a wait for peers
            self.stats.flush_s += time.perf_counter() - start
            start = time.perf_counter()
            self.transport.barrier()
        except ODCTimeoutError as err:
            self._state = EngineState.BROKEN
            if self.replicas > 1 and self._pg is not None:
                # Name the dead rank by its global rank, and tell the other hosts (whose all-reduce fails) who it was.
                raise hsdp.report_failure(err, self._pg) from err
            raise
        except BaseException:
            self._state = EngineState.BROKEN
            raise
        if count_wait:
            self.stats.wait_s += time.perf_counter() - start

    # ------------------------------------------------------------------ dynamic plan
    def claim_microbatches(self, count: int) -> Iterator[int]:
        """Indices of this step's microbatches that this rank runs, claimed one at a time (the ``dynamic`` plan).

        Every rank passes the same ``count`` (the length of the step's queue, e.g.
        `odc_accelerate.planning.claim_queue`, the same on every rank) and runs the microbatch of each index it gets;
        the next index is claimed when the loop asks for it, with an atomic fetch-and-add on the step's counter
        (`odc_accelerate.transport.claims`). Across ranks every index is yielded exactly once; a rank that is free
        first takes the next one, so a slower rank runs fewer. No ``torch.distributed`` call is made. Normalise the
        loss by the step's global count of loss items, known from the queue before the first claim. On an HSDP mesh
        every rank of every replica claims from one queue (planned for all of them; the counter is the
        ``torch.distributed`` store's, `~odc_accelerate.transport.claims.StoreClaimCounter`).

        ```python
        queue = claim_queue(plan_step(lengths, world_size, budget, plan="dynamic"))  # same on every rank
        for i in engine.claim_microbatches(len(queue)):
            loss = compute(model, load(queue[i])) * world_size / global_tokens
            loss.backward()
        engine.pre_optimizer_step()
        ```

        A rank learns that a microbatch was its last only when its next claim finds none left: unless the memory
        policy keeps gradients through the step (``grads`` / ``both``), each microbatch's backward sends them to their
        owners. Call once per optimizer step, between
        ``post_optimizer_step`` and ``pre_optimizer_step``; iterate lazily (collecting the indices first would claim
        them all for this rank).

        Args:
            count (`int`): number of microbatches in the step's queue.

        Raises:
            RuntimeError: called outside a step, twice in one step, or on a frozen engine.
        """
        self._check_trainable("claim_microbatches")
        if self._state != EngineState.IN_STEP:
            raise RuntimeError(
                "claim_microbatches() is for the microbatches of a step: call it before pre_optimizer_step()"
            )
        if self._claimed_step == self.steps:
            raise RuntimeError(
                "claim_microbatches() was already called in this optimizer step: claim the step's whole queue with "
                "one call (every rank's claims of a step draw from one counter)"
            )
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(
                f"count must be the number of microbatches in the step's queue (an int >= 0), got {count!r}"
            )
        self._claimed_step = self.steps
        return claim_indices(self._claims, self.steps + 1, count)  # rounds start at 1

    # ------------------------------------------------------------------ step lifecycle
    @torch.no_grad()
    def pre_optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Wait for every rank's gradient pushes, then write the step's gradients into ``.grad``.

        After this call ``.grad`` equals what FSDP2 would hold for the same total work. Call it once
        per optimizer step, after the last backward and before clipping / ``optimizer.step()``.

        Args:
            optimizer (`torch.optim.Optimizer`, *optional*):
                The optimizer about to step. Given, the ranks check that its param groups hold the same parameters,
                grouped and ordered alike, on every rank (each rank steps its own shard of every parameter, so the
                shards of one parameter must follow one group's settings). Its fingerprint travels with the flags the
                ranks exchange at this barrier anyway: the check adds no communication. Ranks that pass none are not
                compared.

        Raises:
            ValueError: on every rank, when the optimizers' param groups differ across ranks, saying what to change.
                The step is lost: only `close` is allowed after it.
        """
        self._check_trainable("pre_optimizer_step")
        if self._state != EngineState.IN_STEP:
            raise RuntimeError("pre_optimizer_step() called twice without post_optimizer_step() in between")
        self._reduce_kept_grads()  # before the barrier: peers wait for these adds
        self._drop_kept_params()  # the optimizer changes the shards: gathered copies would be stale
        fingerprint, layout = self._optimizer_fingerprint(optimizer)  # the sharded parameters are registered again
        exchanged = self._buffers["touched"]
        exchanged.copy_(torch.tensor([g.touched for g in self._groups] + list(fingerprint), dtype=torch.uint8))
        self._barrier()  # every rank has pushed all of this step's gradients
        start = time.perf_counter()
        rows = exchanged.new_empty((self.world_size, exchanged.numel()))
        for peer in range(self.world_size):
            if peer == self.rank:
                rows[peer].copy_(exchanged)
            else:
                self.transport.read(peer, "touched", rows[peer])
        rows = rows.cpu()  # one device-to-host copy per step, not one per param group
        n = len(self._groups)
        refusal = model_check.optimizer_refusal([bytes(row[n:].tolist()) for row in rows], layout)
        if refusal is not None:  # the same fingerprints on every rank: every rank refuses here
            self._state = EngineState.BROKEN
            raise ValueError(refusal)
        any_touched = rows[:, :n].amax(dim=0)
        if self._replicas is not None:
            self._fold_across_replicas(any_touched)
        else:
            touched_anywhere = any_touched.tolist()
            for g in self._groups:
                if g.reduce_dtype is None or not touched_anywhere[g.index]:
                    continue
                acc = self._buffers[f"g{g.index}"]
                if compat.all_grads_exist(g.group):
                    # Every .grad exists: the fold only adds into them, so it may read the accumulator itself (no
                    # copy of a whole shard at the step's memory peak).
                    compat.fold_into_grads(g.group, acc)
                    acc.zero_()  # safe: no peer adds again before the post-step barrier
                    continue
                reduce_output = acc.clone()  # fresh memory: new .grad tensors become views of it
                acc.zero_()
                compat.fold_into_grads(g.group, reduce_output)
        for g in self._groups:
            g.touched = False
        self.stats.fold_s += time.perf_counter() - start - self.stats.replicate_s
        self._state = EngineState.IN_OPTIMIZER

    def _optimizer_fingerprint(self, optimizer: Any) -> tuple[bytes, list[list[str]] | None]:
        """``optimizer``'s fingerprint and layout (`model_check.optimizer_layout`), read again only when its groups
        change; all zero and None without an optimizer."""
        if optimizer is None:
            return bytes(model_check.FINGERPRINT_BYTES), None
        key = (id(optimizer), tuple(tuple(id(p) for p in group["params"]) for group in optimizer.param_groups))
        if self._optimizer_seen is None or self._optimizer_seen[0] != key:
            layout = model_check.optimizer_layout(self.model, optimizer)
            self._optimizer_seen = (key, model_check.optimizer_fingerprint(layout), layout)
        return self._optimizer_seen[1], self._optimizer_seen[2]

    def _fold_across_replicas(self, touched: torch.Tensor) -> None:
        """HSDP: sum this rank's owned shards over the replicas (bucketed all-reduces), folding as buckets arrive."""
        accumulators = {g.index: self._buffers[f"g{g.index}"] for g in self._groups if f"g{g.index}" in self._buffers}
        waited = time.perf_counter()
        try:
            for index, summed, touched_anywhere in self._replicas.reduce(accumulators, touched):
                blocked = time.perf_counter() - waited
                self.stats.replicate_s += blocked
                self.stats.wait_s += blocked
                if index is not None and touched_anywhere[index]:
                    compat.fold_into_grads(self._groups[index].group, summed)
                waited = time.perf_counter()
        except BaseException:
            self._state = EngineState.BROKEN
            raise
        self.stats.replicate_bytes += self._replicas.nbytes()
        for g in self._groups:
            compat.clear_partial_reduce_output(g.group)

    @property
    def replicate_buckets(self) -> list[list[int]]:
        """HSDP: the param-group indices of each all-reduce bucket (one all-reduce per bucket and step); else []."""
        return self._replicas.bucket_groups if self._replicas is not None else []

    @torch.no_grad()
    def post_optimizer_step(self) -> None:
        """Publish the new shards; peers may read them once every rank has returned from this call."""
        self._check_trainable("post_optimizer_step")
        self._publish()

    def _check_trainable(self, what: str) -> None:
        self._check_usable()
        if self.frozen:
            raise RuntimeError(
                f"{what}() on a frozen (gather-only) ODCEngine: it has no optimizer step. Call republish() on every "
                "rank if its weights changed."
            )

    @torch.no_grad()
    def _publish(self) -> None:
        if self._state != EngineState.IN_OPTIMIZER:
            raise RuntimeError("post_optimizer_step() called without pre_optimizer_step() before it")
        start = time.perf_counter()
        for g in self._groups:
            compat.copy_all_gather_input(g.group, self._buffers[f"p{g.index}"])
        self.stats.publish_s += time.perf_counter() - start
        self._barrier()  # nobody reads a shard before its owner has finished writing it
        if self.steps or self.stats.gathers or self.stats.scatters:
            self.stats.transport_bytes = self.transport.memory_report().get("total", 0)
            self.stats.peak_memory_bytes = self._peak.read()
            self.last_step_stats = self.stats
        self.stats = StepStats()
        self._apply_memory_policy()  # nothing is kept now: free memory is what the next step starts from
        self.steps += 1
        self._state = EngineState.IN_STEP

    # ------------------------------------------------------------------ memory policy
    def _group_costs(self) -> list[memory.GroupCost]:
        costs = []
        for g in self._groups:
            grad_bytes = 0
            if g.reduce_dtype is not None and not self.frozen:
                grad_bytes = g.reduce_numel * self.world_size * g.reduce_dtype.itemsize
            costs.append(
                memory.GroupCost(
                    fqn=g.fqn,
                    param_bytes=g.gather_numel * self.world_size * g.gather_dtype.itemsize,
                    grad_bytes=grad_bytes,
                    gathers_per_microbatch=1 if self.frozen else compat.gathers_per_microbatch(g.group, g.saved_keep),
                    world_size=self.world_size,
                )
            )
        return costs

    def _choose(self) -> dict[str, tuple[bool, bool]]:
        if self._policy == memory.AUTO:
            free, total = memory.free_and_total(self._device)
            budget = free - memory.headroom_bytes(self._headroom, total)
            return memory.choose_auto(self._group_costs(), budget)
        return memory.choose_fixed(self._policy, [g.fqn for g in self._groups])

    def _apply_memory_policy(self) -> None:
        """Choose (``auto``: from this rank's free memory now) and set FSDP2's switches; no peer is involved."""
        choices = self._choose()
        for g in self._groups:
            keep_params, keep_grads = choices[g.fqn]
            g.keep = (keep_params, keep_grads and g.reduce_dtype is not None and not self.frozen)
            compat.set_keep(g.group, g.saved_keep, *g.keep)
        self.stats.kept_params = sum(g.keep[0] for g in self._groups)
        self.stats.kept_grads = sum(g.keep[1] for g in self._groups)

    def memory_choices(self) -> dict[str, str]:
        """What this rank keeps through the current step, per param group FQN (``"both"``, ``"params"``, ...)."""
        return {g.fqn: memory.choice_name(g.keep) for g in self._groups}

    def memory_summary(self) -> str:
        """How many groups keep what on this rank this step (``"both x3, neither x1"``), and the bytes kept."""
        costs = zip(self._groups, self._group_costs(), strict=True)
        kept = sum(c.param_bytes * g.keep[0] + c.grad_bytes * g.keep[1] for g, c in costs)
        return f"{memory.summarize({g.fqn: g.keep for g in self._groups})} ({kept / 2**20:.1f} MiB kept unsharded)"

    def _reduce_kept_grads(self) -> None:
        """Scatter-add every unsharded gradient still held (kept by the policy, or left by a caller's ``no_sync``)."""
        for g in self._groups:
            if g.reduce_dtype is not None and compat.has_pending_grads(g.group):
                compat.reduce_pending_grads(g.group)

    def _drop_kept_params(self) -> None:
        for g in self._groups:
            if compat.is_unsharded(g.group):
                compat.reshard(g.group)

    def reshard(self) -> None:
        """Drop every gathered copy of the parameters that the memory policy keeps (the next forward gathers again).

        While a group keeps them, its modules hold the gathered parameters (as FSDP2 with ``reshard_after_forward``
        off): change weights in place only after this call (then `republish`), or between `pre_optimizer_step` and
        the next forward, where they are dropped already. Local: no peer is involved.
        """
        self._check_usable()
        self._drop_kept_params()

    @torch.no_grad()
    def republish(self) -> None:
        """Collective: publish the shards again after parameters changed outside an optimizer step.

        Call it on every rank after loading a checkpoint (or any in-place change of the sharded
        parameters) and before the next forward; peers would otherwise read the old values.
        """
        self._check_usable()
        # A kept gradient is not scatter-added yet (touched stays False): it shows a microbatch ran all the same.
        if (
            self._state != EngineState.IN_STEP
            or any(g.touched for g in self._groups)
            or any(g.reduce_dtype is not None and compat.has_pending_grads(g.group) for g in self._groups)
        ):
            raise RuntimeError("republish() must run between optimizer steps, before any microbatch of the next one")
        self._drop_kept_params()  # gathered before the change: stale
        for g in self._groups:
            compat.copy_all_gather_input(g.group, self._buffers[f"p{g.index}"])
        self._barrier(count_wait=False)

    # ------------------------------------------------------------------ tear-down
    def close(self) -> None:
        """Restore FSDP2's own collectives and release the transport (shared memory is removed). Idempotent.

        The model keeps working as a plain FSDP2 model while the process group exists. Called after
        ``dist.destroy_process_group()``, it also drops what every FSDP2 module of the process still holds of the
        destroyed groups, so that gloo's worker threads end before the interpreter does.
        """
        if self._state != EngineState.CLOSED or self.transport is not None:
            if self._state != EngineState.BROKEN:
                try:  # a plain FSDP2 model from here on: no gathered copy left behind (a frozen model keeps them)
                    self._drop_kept_params()
                except Exception as err:  # closing must go on: the transport is released below either way
                    logger.warning("Dropping the gathered parameters at close failed: %s", err)
            for g in self._groups:
                if g.saved_keep is not None:
                    compat.set_keep(g.group, g.saved_keep, False, False)
                compat.set_comms(g.group, *g.saved_comms)
                compat.set_sum_and_unused_flags(g.group, *g.saved_flags)
            if self.transport is not None:
                self._buffers = {}  # views of the transport's memory: a GPU segment is freed when the last one dies
                self.transport.close()
                self.transport = None
            self._state = EngineState.CLOSED
        self._pg = None  # set-up only; a closed engine must not keep the group (and gloo's threads) alive
        self._claims = None  # the transport itself, or a store counter: neither may outlive close()
        process_exit.release_destroyed_groups()

    def __enter__(self) -> ODCEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort; after set-up the shared memory has no name to leak
        try:
            if self.transport is not None:
                self.transport.close()
        except Exception:
            pass

    @property
    def param_groups(self) -> list[str]:
        """FQNs of the FSDP2 param groups the engine serves, in registration order."""
        return [g.fqn for g in self._groups]
