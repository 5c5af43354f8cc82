"""ODCEngine: FSDP2 with one-sided gathers and scatter-accumulates, synchronised once per optimizer step.

Per FSDP2 param group, every rank publishes its shard into a transport buffer ``p<i>`` after each optimizer step; the
all-gather hook reads the peers' shards; the reduce-scatter hook adds each owner's rows into its accumulator ``g<i>``
(or, under ``ordered``, into this rank's own contributions) and returns zeros; ``pre_optimizer_step`` meets every rank
at one barrier and folds the accumulator into ``.grad`` with FSDP2's own post-processing. Between
``post_optimizer_step`` and ``pre_optimizer_step`` it makes no torch.distributed call, so ranks may run any number of
microbatches. One step through the code: docs/design.md.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import memory_spec
from .._compat.torch import fsdp as compat
from .._compat.torch import keep as keep_compat
from ..reduction import ReductionName, normalize_reduction
from ..transport import ODCTimeoutError, Transport
from ..transport.base import is_out_of_memory
from ..transport.claims import claim_indices
from ..transport.ordered import add_contribution, contribution_names, sum_in_rank_order, zero_contributions
from . import _setup, hsdp, memory, model_check, process_exit
from ._common import ServedGroup
from ._hooks import accumulator_rows
from .report import EngineReport
from .stats import EngineState, StepStats
from .streams import LocalAddFence, current_stream_of

logger = logging.getLogger(__name__)


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
            against group FQNs (see `odc_accelerate.engine.memory`). The result equals ``"neither"`` up to summation
            order. A frozen engine keeps gathered params until `republish`.
        memory_headroom (`str` or `float`, *optional*, defaults to `"30%"`):
            What ``"auto"`` leaves free for activations and the optimizer: a percentage of this rank's memory
            (``"30%"``) or a size (``"4GiB"``; a number is bytes).
        reduction (`str` or `ReductionName`, *optional*, defaults to `"auto"`):
            How gradients reach their owners (``docs/reduction.md``): ``"atomic"`` (each microbatch's gradients are
            added into the owners' accumulators as ranks finish) or ``"ordered"`` (each rank sums its step locally,
            into one buffer per owner, and each owner sums the ranks' contributions in rank order at
            `pre_optimizer_step`: bitwise reproducible, no peer atomics, one unsharded gradient held per rank; the
            memory policy's ``grads`` choice does not apply). ``"auto"``: the transport decides
            (`Transport.choose_reduction`): ``"atomic"`` where it adds atomically (every CPU transport; the ``cuda``
            transport over GPUs with native peer-to-peer atomics and deterministic algorithms off), else ``"ordered"``,
            said in a warning. ``reduction`` holds what runs, `report` why. A frozen engine reduces nothing.

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
        memory_policy: str | Mapping[str, str] = memory_spec.DEFAULT_POLICY,
        memory_headroom: str | float = memory_spec.DEFAULT_HEADROOM,
        reduction: ReductionName | str = ReductionName.AUTO,
    ) -> None:
        self._state = EngineState.CLOSED  # until fully built, close() has nothing to undo
        self._groups: list[ServedGroup] = []
        self.transport: Transport | None = None
        self._replicas: hsdp.ReplicaReducer | None = None
        self._pg: Any = None  # the shard group's process group: set-up only
        self._claims: Any = None  # the dynamic plan's counter (set with the transport)
        # Checked before any collective: the same bad value raises on every rank.
        self._requested = normalize_reduction(reduction, "reduction")
        #: the gradient reduction this engine runs (``auto``: chosen with the transport; `report` says why)
        self.reduction = ReductionName.ATOMIC if self._requested == ReductionName.AUTO else self._requested
        self._report: EngineReport | None = None  # what set-up chose (`report`)
        self._contributed: set[int] = set()  # ordered: groups whose contributions this rank added into this step
        self._policy = memory_spec.parse_policy(memory_policy)
        self._headroom = memory_spec.parse_headroom(memory_headroom)
        self.memory_policy = memory_policy
        _setup.check_arguments(
            model, timeout, sync_every_hook=sync_every_hook, policy=self._policy, memory_policy=memory_policy
        )
        refusal = _setup.lazy_init(model)  # raised in `_setup.serve`, on every rank
        self.model, self.timeout, self.sync_every_hook = model, float(timeout), sync_every_hook
        self.frozen = bool(frozen)
        if self.frozen:
            _setup.check_frozen(model)
        self.stats = StepStats()
        self.last_step_stats: StepStats | None = None
        self.steps = 0
        self._claimed_step = -1
        self._optimizer = model_check.OptimizerFingerprints(model)
        served = _setup.serve(model, refusal, transport)
        self._pg, self._device = served.shard_pg, served.device
        #: ordered: the streams this rank's local adds ran on (FSDP2's reduce-scatter stream on a GPU)
        self._fence = LocalAddFence(current_stream_of(self._device))
        self.rank, self.world_size = dist.get_rank(self._pg), dist.get_world_size(self._pg)
        #: replicas of each shard (1 without HSDP); the engine's ``world_size`` is the shard group's
        self.replicas = dist.get_world_size(served.replicate_pg) if served.replicate_pg is not None else 1
        self._groups, specs = _setup.build_groups(served, frozen=self.frozen)
        self._start(transport, specs, served, replicate_bucket_bytes)
        process_exit.watch(self)
        _setup.log_ready(self)

    def _start(
        self, transport: str | Transport, specs: dict[str, Any], served: _setup.Served, bucket_bytes: int
    ) -> None:
        """Collective: create the transport, choose the reduction, register the buffers, install the hooks and publish
        the first shards; on any error after the transport exists, close and raise."""
        hsdp_mesh = served.replicate_pg is not None
        # Only an explicit ``atomic`` needs peer atomics up front; under ``auto`` the transport may choose ``ordered``.
        atomics = self._requested == ReductionName.ATOMIC and not self.frozen
        choice, self.transport = _setup.open_transport(
            transport, served, rank=self.rank, world_size=self.world_size, timeout=self.timeout, atomics=atomics
        )
        try:
            reduced = "frozen: nothing is reduced"
            if not self.frozen:
                self.reduction, reduced = self.transport.choose_reduction(self._requested)
                if self.ordered:
                    specs = _setup.ordered_specs(self._groups, specs, self.world_size, self._device)
                if self._requested == ReductionName.AUTO and self.ordered and self.rank == 0:
                    logger.warning("ODC gradient reduction: ordered (%s)", reduced)
            if hsdp_mesh and not self.frozen:
                self._replicas = _setup.replica_reducer(served, self._groups, specs, self.timeout, bucket_bytes)
            self._buffers = self.transport.register(specs)
            self._report = _setup.setup_report(self, choice, reduced)
            scatter = None if self.frozen else self._scatter_accumulate
            _setup.install_hooks(self._groups, self._gather, scatter, hsdp_mesh=hsdp_mesh)
            self._claims = _setup.claims(self.transport, self._pg, frozen=self.frozen, replicas=self.replicas)
            self._peak = memory_spec.PeakMemory(self._device)
            self._state = EngineState.IN_OPTIMIZER  # so that the initial publish is the normal post-step path
            self._publish()
            self.steps = 0
        except BaseException as err:
            self._state = EngineState.BROKEN
            held = self.transport.memory_report().get("total", 0) if self.transport is not None else 0
            # Closing tells the peers waiting for this rank in a barrier that it will not come.
            self.close()
            if is_out_of_memory(err):
                raise _setup.setup_refusal(err, self._device, held) from err
            raise

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
                "a backward ran after engine.pre_optimizer_step() and before engine.post_optimizer_step() (in a "
                "plain accelerate loop, accelerator.clip_grad_norm_ with sync_gradients makes that call); run every "
                "microbatch's backward of the step before pre_optimizer_step() / clipping, and step the optimizer "
                "before the next backward"
            )
        if op != dist.ReduceOp.SUM:
            raise RuntimeError(f"ODC expects sum reductions (the engine owns the divisor), FSDP2 passed {op}")
        start = self._enter_hook()
        g = self._groups[index]
        rows = accumulator_rows(g, inp, self.world_size)
        if self.ordered:
            # A local add into this rank's own contribution to each owner, in its microbatches' order: no atomics.
            self._fence.before_add()
            add_contribution(self._buffers, f"c{index}", rows)
            self._fence.after_add()
            self._contributed.add(index)
        else:
            self._scatter_to_owners(index, rows)
        out.zero_()
        g.touched = True
        self.stats.scatters += 1
        self.stats.bytes_accumulated += inp.numel() * inp.element_size()
        self.stats.scatter_s += time.perf_counter() - start

    def _scatter_to_owners(self, index: int, rows: torch.Tensor) -> None:
        """The atomic reduction: add row ``o`` into owner ``o``'s accumulator, for every owner."""
        name = f"g{index}"
        # Start with the next rank so that ranks finishing a layer together hit different owners.
        for k in range(1, self.world_size + 1):
            owner = (self.rank + k) % self.world_size
            self.transport.accumulate(owner, name, rows[owner])

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
        memory.reduce_kept_grads(self._groups)  # before the barrier: peers wait for these adds
        memory.drop_kept_params(self._groups)  # the optimizer changes the shards: gathered copies would be stale
        layout = self._write_flags(optimizer)
        self._fence.wait_for_adds()  # ordered: this rank's contributions are complete before any owner reads them
        self._barrier()  # every rank has pushed all of this step's gradients
        start = time.perf_counter()
        rows = self._read_flags()
        n = len(self._groups)
        refusal = model_check.optimizer_refusal([bytes(row[n:].tolist()) for row in rows], layout)
        if refusal is not None:  # the same fingerprints on every rank: every rank refuses here
            self._state = EngineState.BROKEN
            raise ValueError(refusal)
        any_touched = rows[:, :n].amax(dim=0)
        if self.ordered:
            self._sum_contributions(any_touched.tolist())
        if self._replicas is not None:
            try:  # HSDP: sum the owned shards over the replicas, folding as their buckets arrive
                self._replicas.fold(self._groups, self._buffers, any_touched, self.stats)
            except BaseException:
                self._state = EngineState.BROKEN
                raise
        else:
            self._fold(any_touched.tolist())
        for g in self._groups:
            g.touched = False
        self.stats.fold_s += time.perf_counter() - start - self.stats.replicate_s - self.stats.exchange_s
        self._state = EngineState.IN_OPTIMIZER

    @property
    def state(self) -> EngineState:
        """Where the engine is in its optimizer-step cycle (``IN_STEP``: microbatches may run; ``IN_OPTIMIZER``: the
        gradients are folded, the optimizer may step; ``CLOSED`` / ``BROKEN``)."""
        return self._state

    @property
    def ordered(self) -> bool:
        """This engine runs the ordered reduction (``reduction == "ordered"``)."""
        return self.reduction == ReductionName.ORDERED

    def _sum_contributions(self, touched_anywhere: list[bool]) -> None:
        """The ordered reduction's exchange (after the step's barrier): per group a backward reached on some rank, sum
        every rank's contribution to this rank's shard, in rank order, into the group's accumulator ``g<i>``, which
        the fold then reads as under ``atomic``. The contributions are zeroed only after the post-step barrier
        (`_publish`): until every rank has passed it, a peer may still be reading them."""
        start = time.perf_counter()
        for g in self._groups:
            if g.reduce_dtype is None or not touched_anywhere[g.index]:
                continue
            names = contribution_names(f"c{g.index}", self.world_size)
            acc = self._buffers[f"g{g.index}"]
            sum_in_rank_order(self.transport, names, acc, scratch=self._buffers[_setup.scratch_name(g.reduce_dtype)])
            self.stats.bytes_read += (self.world_size - 1) * g.reduce_numel * g.reduce_dtype.itemsize
        self.stats.exchange_s += time.perf_counter() - start

    def _write_flags(self, optimizer: Any) -> list[list[str]] | None:
        """Write this rank's flags into ``touched``: which groups its backward reached, then its optimizer's
        fingerprint. Returns the optimizer's layout (None without one)."""
        # The optimizer's param groups are read again only when they change (the sharded parameters are registered
        # again, as by accelerate's prepare).
        fingerprint, layout = self._optimizer.read(optimizer)
        flags = torch.tensor([g.touched for g in self._groups] + list(fingerprint), dtype=torch.uint8)
        self._buffers["touched"].copy_(flags)
        return layout

    def _read_flags(self) -> torch.Tensor:
        """Every rank's ``touched`` flags (after the barrier), one row per rank, on the CPU."""
        exchanged = self._buffers["touched"]
        rows = exchanged.new_empty((self.world_size, exchanged.numel()))
        for peer in range(self.world_size):
            if peer == self.rank:
                rows[peer].copy_(exchanged)
            else:
                self.transport.read(peer, "touched", rows[peer])
        return rows.cpu()  # one device-to-host copy per step, not one per param group

    def _fold(self, touched_anywhere: list[bool]) -> None:
        """Fold each accumulator a backward reached on some rank into ``.grad`` and zero it (1-D mesh)."""
        for g in self._groups:
            if g.reduce_dtype is None or not touched_anywhere[g.index]:
                continue
            acc = self._buffers[f"g{g.index}"]
            if compat.all_grads_exist(g.group):
                # Every .grad exists: the fold only adds into them, so it may read the accumulator itself (no copy of
                # a whole shard at the step's memory peak).
                compat.fold_into_grads(g.group, acc)
                acc.zero_()  # safe: no peer adds again before the post-step barrier
                continue
            reduce_output = acc.clone()  # fresh memory: new .grad tensors become views of it
            acc.zero_()
            compat.fold_into_grads(g.group, reduce_output)

    def report(self) -> EngineReport:
        """What this engine chose at set-up and why (transport, reduction, accumulate path, replicas), with what the
        memory policy keeps on this rank now: what its log line and the Trainer's banner say."""
        return dataclasses.replace(self._report, memory=self.memory_summary())

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
        # Ordered: past this barrier every owner has summed this step's contributions (it folded before its optimizer
        # step, and it reached the barrier after that): no peer reads them any more, and the next step adds afresh.
        for index in sorted(self._contributed):
            zero_contributions(self._buffers, f"c{index}", self.world_size)
        if self._contributed:
            self._fence.after_zero()
        self._contributed.clear()
        if self.steps or self.stats.gathers or self.stats.scatters:
            self.last_step_stats = self.stats.finish(self.transport.memory_report().get("total", 0), self._peak.read())
        self.stats = StepStats()
        self._apply_memory_policy()  # nothing is kept now: free memory is what the next step starts from
        self.steps += 1
        self._state = EngineState.IN_STEP

    # ------------------------------------------------------------------ memory policy
    def _apply_memory_policy(self) -> None:
        """Choose (``auto``: from this rank's free memory now) and set FSDP2's switches; no peer is involved."""
        choices = memory.choose(
            self._policy,
            self._headroom,
            self._device,
            self._groups,
            world_size=self.world_size,
            frozen=self.frozen,
            ordered=self.ordered,
        )
        self.stats.kept_params, self.stats.kept_grads = memory.apply_choices(
            self._groups, choices, frozen=self.frozen, ordered=self.ordered
        )

    def may_keep_grads(self) -> bool:
        """Whether the memory policy as configured may keep unsharded gradients through a step on some rank (``auto``
        may; ``grads`` / ``both`` for a trainable group do): the same answer on every rank."""
        return memory.may_keep_grads(self._policy, self._groups, frozen=self.frozen, ordered=self.ordered)

    def memory_choices(self) -> dict[str, str]:
        """What this rank keeps through the current step, per param group FQN (``"both"``, ``"params"``, ...)."""
        return {g.fqn: memory.choice_name(g.keep) for g in self._groups}

    def memory_summary(self) -> str:
        """How many groups keep what on this rank this step (``"both x3, neither x1"``), and the bytes kept."""
        return memory.kept_summary(self._groups, world_size=self.world_size, frozen=self.frozen)

    def reshard(self) -> None:
        """Drop every gathered copy of the parameters that the memory policy keeps (the next forward gathers again).

        While a group keeps them, its modules hold the gathered parameters (as FSDP2 with ``reshard_after_forward``
        off): change weights in place only after this call (then `republish`), or between `pre_optimizer_step` and
        the next forward, where they are dropped already. Local: no peer is involved.
        """
        self._check_usable()
        memory.drop_kept_params(self._groups)

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
            or any(g.reduce_dtype is not None and keep_compat.has_pending_grads(g.group) for g in self._groups)
        ):
            raise RuntimeError("republish() must run between optimizer steps, before any microbatch of the next one")
        memory.drop_kept_params(self._groups)  # gathered before the change: stale
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
                    memory.drop_kept_params(self._groups)
                except Exception as err:  # closing must go on: the transport is released below either way
                    logger.warning("Dropping the gathered parameters at close failed: %s", err)
            _setup.restore_hooks(self._groups)
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
