"""Per-rank body of the ordered reduction's transport tests (`odc_accelerate.transport.ordered`).

One process group runs the protocol on every transport in turn (``shm``, ``network``, ``hierarchical`` and the
``cuda`` transport's protocol on CPU), so one start of the ranks covers them all. The microbatch gradients are
generated from seeds by every process alike, so the test process computes its reference independently.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

# name -> the group's shard numel and the contributions' dtype (the sum is always fp32)
GROUPS = {"c0": (1000, torch.float32), "c1": (37, torch.float32), "c2": (64, torch.bfloat16)}


def microbatch_rows(step: int, rank: int, index: int, world_size: int, group: str) -> torch.Tensor:
    """Microbatch ``index`` of ``rank`` in ``step``: a ``[world_size, shard]`` reduce-scatter input whose fp32 values
    span 40 binary orders of magnitude, so that sums taken in another order round differently."""
    numel, dtype = GROUPS[group]
    gen = np.random.default_rng([step, rank, index, world_size, list(GROUPS).index(group)])
    values = gen.standard_normal((world_size, numel)) * np.exp2(gen.integers(-20, 21, (world_size, numel)))
    return torch.from_numpy(values.astype(np.float32)).to(dtype)


def _transport(kind: str, rank: int, world_size: int):
    from odc_accelerate.transport import create_transport

    if kind == "cuda-on-cpu":
        from tests.gpu.check_common import CpuSegmentsCudaTransport

        os.environ["ODC_HOST_ID"] = "one-host"
        return CpuSegmentsCudaTransport(rank, world_size, timeout=60.0)
    if kind == "shm":
        os.environ["ODC_HOST_ID"] = "one-host"
    elif kind == "network":
        os.environ["ODC_HOST_ID"] = f"host-{rank}"  # every rank its own host
    else:  # hierarchical: two hosts, the first with half the ranks (rounded up)
        os.environ["ODC_HOST_ID"] = f"host-{int(rank >= (world_size + 1) // 2)}"
    return create_transport(kind, rank=rank, world_size=world_size, timeout=60.0, device=torch.device("cpu"))


class _AtomicCounter:
    """Counts every call into the 'cuda' transport's accumulate paths: its `accumulate`, the accumulate kernel's entry
    point and the ``index_add_`` fallback's staging pool."""

    def __init__(self) -> None:
        from odc_accelerate.transport.cuda import transport as cuda_module
        from odc_accelerate.transport.cuda.segments import StagingPool

        self.calls = {"CudaTransport.accumulate": 0, "accumulate_ (kernel)": 0, "StagingPool.add (index_add_)": 0}
        targets = [
            (cuda_module.CudaTransport, "accumulate", "CudaTransport.accumulate"),
            (cuda_module, "accumulate_", "accumulate_ (kernel)"),
            (StagingPool, "add", "StagingPool.add (index_add_)"),
        ]
        for owner, attr, key in targets:
            setattr(owner, attr, self._counted(getattr(owner, attr), key))

    def _counted(self, fn, key: str):
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[key] += 1
            return fn(*args, **kwargs)

        return counted


def ordered_steps(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``spec["counts"][step][rank]`` microbatches per step on each transport of ``spec["transports"]``; return,
    per transport, this rank's summed shard of every group after every step (and, on ``cuda-on-cpu``, the calls into
    the accumulate paths during the steps, then after one deliberate accumulate)."""
    from odc_accelerate.transport import BufferSpec
    from odc_accelerate.transport.ordered import (
        add_contribution,
        contribution_names,
        contribution_specs,
        sum_in_rank_order,
        zero_contributions,
    )

    out: dict[str, Any] = {}
    for kind in spec["transports"]:
        transport = _transport(kind, rank, world_size)
        specs: dict[str, BufferSpec] = {}
        for group, (numel, dtype) in GROUPS.items():
            specs.update(contribution_specs(group, numel, dtype, world_size))
        counter = None
        if kind == "cuda-on-cpu":
            specs["probe"] = BufferSpec(numel=16, dtype=torch.float32, accumulated=True)  # the positive control
        buffers = transport.register(specs)
        if kind == "cuda-on-cpu":
            counter = _AtomicCounter()  # after set-up, whose probe launches the kernel on a scratch area
        scratch = torch.empty(max(numel for numel, _ in GROUPS.values()), dtype=torch.float32)
        sums = []
        for step, counts in enumerate(spec["counts"]):
            for index in range(counts[rank]):
                for group in GROUPS:
                    add_contribution(buffers, group, microbatch_rows(step, rank, index, world_size, group))
            transport.barrier()  # every contribution of the step is complete
            mine = {}
            for group, (numel, _) in GROUPS.items():
                total = torch.empty(numel, dtype=torch.float32)
                sum_in_rank_order(transport, contribution_names(group, world_size), total, scratch=scratch)
                mine[group] = total.numpy().copy()
            transport.barrier()  # every owner has read every contribution
            for group in GROUPS:
                zero_contributions(buffers, group, world_size)
            sums.append(mine)
        result: dict[str, Any] = {"transport": transport.name, "sums": sums}
        if counter is not None:
            result["atomic_calls"] = dict(counter.calls)
            transport.accumulate(0, "probe", torch.ones(16))  # the counter sees an accumulate when there is one
            result["atomic_calls_after_one_accumulate"] = dict(counter.calls)
            result["accumulate_path"] = transport.accumulate_path
        transport.barrier()
        del buffers
        transport.close()
        out[kind] = result
    return out
