"""HSDP under ODC: one bucketed all-reduce of the folded gradient shards across replicas per optimizer step.

The shard group runs as on a 1-D mesh; :class:`ReplicaReducer` all-reduces each owner's summed shard across replicas
once, at ``pre_optimizer_step`` (buckets in flight while earlier ones fold; the "touched" flags ride in the first).
:func:`check_shard_group_hosts` refuses a shard group that spans hosts; :func:`report_failure` and
:func:`explain_failure` make every surviving rank's error name a rank that died. See docs/multinode.md.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._compat.torch import c10d as c10d_compat
from .._compat.torch import fsdp as compat
from ..transport.base import ODCTimeoutError
from .stats import StepStats

logger = logging.getLogger(__name__)

#: Default bucket size of the replicate all-reduce (bytes); a bucket holds whole param groups, so a group larger than
#: this travels alone.
DEFAULT_BUCKET_BYTES = 64 * 2**20
_FAILURE_KEY = "odc/hsdp/failure"
_NOTE_WAIT_S = 30.0  # how long a rank whose all-reduce failed waits for the note of the rank that saw the death


def check_shard_group_hosts(shard_groups: list[list[int]], *, spans_hosts: bool) -> None:
    """Collective over the whole job: refuse the mesh if any shard group's ranks run on more than one host.

    ODC's per-layer traffic inside a shard group needs shared memory (CPU) or CUDA IPC (GPU), both within a host.
    A transport chosen explicitly that spans hosts (`~odc_accelerate.transport.Transport.spans_hosts`: ``network``,
    ``hierarchical``) is accepted. Every rank decides from every rank's host, so all raise together.

    Args:
        shard_groups (`list[list[int]]`): the global ranks of each shard group (the rows of the 2-D mesh).
        spans_hosts (`bool`): the engine's transport reaches other hosts.

    Raises:
        ValueError: on every rank, naming the hosts and the fix.
    """
    from ..transport.hierarchical import gather_hosts, host_layout

    if spans_hosts:
        return
    hosts = gather_hosts(None, dist.get_world_size())
    spread = [ranks for ranks in shard_groups if len({hosts[r] for r in ranks}) > 1]
    if not spread:
        return
    per_host = [len(ranks) for ranks in host_layout(hosts)]
    shard = min(per_host)
    raise ValueError(
        f"ODC with HSDP needs each shard group on one host, but the shard group of ranks {spread[0]} spans "
        f"{len({hosts[r] for r in spread[0]})} hosts (the job runs {per_host} processes on {len(per_host)} hosts). "
        f"Make the shard dimension fit in a node: set dp_shard_size (parallelism_config_dp_shard_size) to the "
        f"processes per node ({shard}) or a divisor of it, and dp_replicate_size to the rest "
        f"({dist.get_world_size() // shard} with dp_shard_size {shard}). On CPU, full sharding across hosts is "
        "possible with a 1-D mesh (no parallelism_config) and odc_transport: hierarchical."
    )


@dataclass
class _Bucket:
    indices: list[int]  # engine group indices, in order
    numels: list[int]
    dtype: torch.dtype
    flags: int  # trailing elements that carry the touched flags (first bucket only)


class ReplicaReducer:
    """Sum each owner's gradient shards over the replicate group, once per optimizer step, in buckets.

    Args:
        group (`torch.distributed.ProcessGroup`): the replicate group (the same shard of every replica).
        layout (`Sequence[tuple[int, int, torch.dtype]]`): ``(group index, numel, dtype)`` of every accumulator the
            engine holds, in order.
        num_groups (`int`): the engine's param groups (the touched flags' length).
        device (`torch.device`): where the accumulators live.
        timeout (`float`): seconds the all-reduces may take before the step is declared lost.
        bucket_bytes (`int`, *optional*): target bucket size; consecutive groups of one dtype share a bucket up to it.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        layout: Sequence[tuple[int, int, torch.dtype]],
        num_groups: int,
        device: torch.device,
        timeout: float,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.group = group
        self.size = dist.get_world_size(group)
        self.ranks = dist.get_process_group_ranks(group)
        self.device = device
        self.timeout = float(timeout)
        self.num_groups = num_groups
        self.buckets: list[_Bucket] = []
        for index, numel, dtype in layout:
            last = self.buckets[-1] if self.buckets else None
            if (
                last is not None
                and last.dtype == dtype
                and (sum(last.numels) + numel) * dtype.itemsize <= bucket_bytes
            ):
                last.indices.append(index)
                last.numels.append(numel)
            else:
                self.buckets.append(_Bucket([index], [numel], dtype, 0))
        if not self.buckets:  # nothing trainable: the flags still travel, so that every rank agrees
            self.buckets.append(_Bucket([], [], torch.float32, 0))
        self.buckets[0].flags = num_groups

    @property
    def bucket_groups(self) -> list[list[int]]:
        """The engine group indices of each bucket (one all-reduce per bucket and step)."""
        return [list(b.indices) for b in self.buckets]

    def reduce(
        self, accumulators: dict[int, torch.Tensor], touched: torch.Tensor
    ) -> Iterator[tuple[int | None, torch.Tensor | None, list[bool]]]:
        """Start every bucket's all-reduce, then yield ``(group index, summed shard, touched anywhere)`` in order.

        ``accumulators`` are copied into fresh bucket memory and zeroed (no peer adds again before the next
        post-step barrier); the yielded shards are views of the buckets (FSDP2's fold may make ``.grad`` a view of
        them). The first item yielded is ``(None, None, flags)`` once the flags have arrived.

        Raises:
            ODCTimeoutError: an all-reduce failed or did not finish within ``timeout``; names the rank that died when
                a peer of its host reported it, else the replicate group's ranks.
        """
        buffers, works = [], []
        for bucket in self.buckets:
            parts = [accumulators[i].view(-1) for i in bucket.indices]
            if bucket.flags:
                parts.append(touched.to(device=self.device, dtype=bucket.dtype).view(-1))
            buffer = torch.cat(parts) if parts else torch.zeros(0, dtype=bucket.dtype, device=self.device)
            for i in bucket.indices:
                accumulators[i].zero_()
            buffers.append(buffer)
            try:
                works.append(dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True))
            except Exception as err:
                raise self._failure(err) from err
        flags: list[bool] | None = None
        for bucket, buffer, work in zip(self.buckets, buffers, works, strict=True):
            self._wait(work)
            if flags is None:
                flags = [v > 0 for v in buffer[buffer.numel() - bucket.flags :].tolist()]
                yield None, None, flags
            offset = 0
            for index, numel in zip(bucket.indices, bucket.numels, strict=True):
                yield index, buffer.narrow(0, offset, numel), flags
                offset += numel

    def fold(
        self, groups: Sequence[Any], buffers: Mapping[str, torch.Tensor], touched: torch.Tensor, stats: StepStats
    ) -> None:
        """Sum this rank's owned shards over the replicas (`reduce`), folding each into ``.grad`` as its bucket arrives.

        Args:
            groups: the engine's param groups (``index`` and FSDP2 ``group`` of each), by index.
            buffers: the engine's transport buffers; ``g<i>`` is group ``i``'s accumulator, where it has one.
            touched: per group, whether a backward reached it on any rank of this shard group.
            stats: the step's figures: time blocked counts in ``replicate_s`` and ``wait_s``, bytes in
                ``replicate_bytes``.
        """
        accumulators = {g.index: buffers[f"g{g.index}"] for g in groups if f"g{g.index}" in buffers}
        waited = time.perf_counter()
        for index, summed, touched_anywhere in self.reduce(accumulators, touched):
            blocked = time.perf_counter() - waited
            stats.replicate_s += blocked
            stats.wait_s += blocked
            if index is not None and touched_anywhere[index]:
                compat.fold_into_grads(groups[index].group, summed)
            waited = time.perf_counter()
        stats.replicate_bytes += self.nbytes()
        for g in groups:
            compat.clear_partial_reduce_output(g.group)

    def nbytes(self) -> int:
        """Bytes one step's all-reduces carry (per rank, before the algorithm's own factor)."""
        return sum((sum(b.numels) + b.flags) * b.dtype.itemsize for b in self.buckets)

    def _wait(self, work: dist.Work) -> None:
        start = time.monotonic()
        try:
            finished = work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except Exception as err:
            raise self._failure(err) from err
        if finished is False:
            raise self._failure(TimeoutError(f"no answer within {time.monotonic() - start:.1f}s"))

    def _failure(self, err: BaseException) -> ODCTimeoutError:
        note = explain_failure(wait_s=min(self.timeout, _NOTE_WAIT_S))
        if note is not None:
            text, dead = note
            return ODCTimeoutError(f"ODC (HSDP): the all-reduce across replicas failed: {text}", dead)
        others = [r for r in self.ranks if r != dist.get_rank()]
        return ODCTimeoutError(
            f"ODC (HSDP) on rank {dist.get_rank()}: the all-reduce across replicas with rank(s) {others} failed: "
            f"{err}. One of them (or a rank of its host) exited, hung or became unreachable; the optimizer step is "
            "lost.",
            others,
        )


# ---------------------------------------------------------------------- failure notes through the job's store
def _store() -> object | None:
    try:
        return c10d_compat.default_store()
    except Exception:  # no store (a bare init with a file:// method, or already destroyed): no note
        return None


def report_failure(err: ODCTimeoutError, shard_group: dist.ProcessGroup) -> ODCTimeoutError:
    """Turn a shard-group barrier error into one that names global ranks, and leave it as a note for other hosts."""
    dead = [dist.get_global_rank(shard_group, r) for r in err.ranks]
    text = (
        f"global rank(s) {dead} (seen by rank {dist.get_rank()}, on the same host, at the shard group's barrier): "
        f"{err}"
    )
    store = _store()
    if store is not None:
        try:
            # The first note wins: later ones come from ranks that saw a peer leave because of the first failure.
            store.compare_set(_FAILURE_KEY, "", ",".join(map(str, dead)) + "|" + text)
        except Exception as store_err:  # the store lives in a process that may be the one that died
            logger.debug("could not leave the failure note: %s", store_err)
    return ODCTimeoutError(f"ODC (HSDP): {text}", dead)


def explain_failure(wait_s: float) -> tuple[str, list[int]] | None:
    """The note a rank left about a dead peer (waiting up to ``wait_s`` for it) and the ranks it names, or None."""
    store = _store()
    if store is None:
        return None
    try:
        store.wait([_FAILURE_KEY], datetime.timedelta(seconds=wait_s))
        text = store.get(_FAILURE_KEY).decode()
    except Exception:
        return None
    ranks, _, text = text.partition("|")
    return text, [int(r) for r in ranks.split(",") if r]
