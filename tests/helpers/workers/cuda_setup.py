"""Workers for the 'cuda' transport's set-up watchdog, on CPU: the transport's protocol over shared memory
(`CpuSegmentsCudaTransport`) with the symmetric-memory allocation or rendezvous made to fail or hang on one rank."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from odc_accelerate.transport import BufferSpec
from tests.gpu.check_common import CpuSegmentsCudaTransport

FOREVER = 3600.0  # longer than any test's limit: only the watchdog can end it


class StuckSetupTransport(CpuSegmentsCudaTransport):
    """``mode="fail"``: rank 1 fails in the rendezvous (a socket error) while rank 0 waits in it;
    ``mode="hang"``: rank 1 never finishes allocating;
    ``mode="oom"``: rank 1 runs out of GPU memory allocating its segment (``oom_error``: how: torch's allocator, or a
    driver error as symmetric memory raises it), with ``free_bytes`` stated free."""

    def __init__(self, rank: int, world_size: int, mode: str, oom_error: str = "allocator", **kwargs: Any) -> None:
        super().__init__(rank, world_size, **kwargs)
        self.mode, self.oom_error = mode, oom_error

    def _allocate_segment(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if self.rank == 1 and self.mode == "oom":
            if self.oom_error == "allocator":
                raise torch.OutOfMemoryError("emulated: CUDA out of memory. Tried to allocate the ODC segment")
            raise RuntimeError("emulated: CUDA error: out of memory")  # what a failed cuMemCreate raises
        if self.rank == 1 and self.mode == "hang":
            time.sleep(FOREVER)
        return super()._allocate_segment(nbytes, device)

    def _exchange_segments(self, own: torch.Tensor, nbytes: int) -> list[torch.Tensor]:
        if self.rank == 1 and self.mode == "fail":
            from odc_accelerate.transport.cuda.watchdog import RENDEZVOUS

            while self._phase_of(0) < RENDEZVOUS:  # fail once rank 0 is blocked in the rendezvous
                time.sleep(0.01)
            raise RuntimeError("emulated: the rendezvous' socket failed")
        if self.rank == 0 and self.mode == "fail":
            time.sleep(FOREVER)  # torch's rendezvous waits for rank 1 in C++, with no timeout
        return super()._exchange_segments(own, nbytes)


def stuck_setup_worker(rank: int, world_size: int, spec: dict[str, Any]) -> str:
    """Register a `StuckSetupTransport`; its stderr goes to ``spec["dir"]/rank<r>.stderr``, its pid to ``.pid``."""
    out = Path(spec["dir"])
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    os.dup2(os.open(out / f"rank{rank}.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
    extra = {k: spec[k] for k in ("free_bytes", "oom_error") if k in spec}
    # ``rank_timeouts``: a longer timeout on a rank makes the order in which the ranks give up certain.
    timeout = spec.get("rank_timeouts", {}).get(rank, spec["timeout"])
    transport = StuckSetupTransport(rank, world_size, spec["mode"], timeout=timeout, **extra)
    transport.register(
        {
            "p0": BufferSpec(numel=64, dtype=torch.float32),
            "g0": BufferSpec(numel=64, dtype=torch.float32, accumulated=True),
        }
    )
    transport.close()
    return "registered"


def engine_publish_oom_worker(rank: int, world_size: int, spec: dict[str, Any]) -> str:
    """Build an engine over the emulated 'cuda' transport where rank 1 runs out of GPU memory while it publishes its
    first shards (after the transport's memory check passed); return this rank's error text."""
    from odc_accelerate._compat.torch import fsdp as fsdp_compat
    from odc_accelerate.engine import ODCEngine
    from odc_accelerate.testing.models import ToyConfig, build_model, shard_model

    out = Path(spec["dir"])
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    model = shard_model(build_model(ToyConfig(), seed=0))
    if rank == 1:

        def out_of_memory(group: Any, buffer: torch.Tensor) -> None:
            raise torch.OutOfMemoryError("emulated: CUDA out of memory. Tried to allocate a parameter's cast copy")

        fsdp_compat.copy_all_gather_input = out_of_memory
    transport = CpuSegmentsCudaTransport(rank, world_size, timeout=spec["timeout"])
    try:
        ODCEngine(model, transport=transport, timeout=spec["timeout"])
    except Exception as err:  # the refusal under test
        return f"{type(err).__name__}: {err}"
    return ""


def _out_of_memory(kind: str) -> Exception:
    """An emulated CUDA out-of-memory error: torch's allocator's (``"allocator"``) or a driver error (``"driver"``)."""
    if kind == "driver":
        return RuntimeError("emulated: CUDA error: out of memory")
    return torch.OutOfMemoryError("emulated: CUDA out of memory. Tried to allocate 2.00 MiB")


def lazy_init_oom_worker(rank: int, world_size: int, spec: dict[str, Any]) -> str:
    """Build an engine whose FSDP2 lazy initialisation runs out of GPU memory on the ranks ``spec["ranks"]`` (default:
    every rank), as creating FSDP2's CUDA streams did on a nearly full H100 (a driver error, not torch's allocator's);
    return this rank's error text."""
    from odc_accelerate._compat.torch import fsdp as fsdp_compat
    from odc_accelerate.engine import ODCEngine
    from odc_accelerate.testing.models import ToyConfig, build_model, shard_model

    out = Path(spec["dir"])
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    model = shard_model(build_model(ToyConfig(), seed=0))

    def out_of_memory(module: Any) -> None:
        raise _out_of_memory(spec["oom_error"])

    if rank in spec.get("ranks", range(world_size)):
        fsdp_compat.lazy_init = out_of_memory
    try:
        ODCEngine(model, transport=CpuSegmentsCudaTransport(rank, world_size, timeout=60.0), timeout=60.0)
    except Exception as err:  # the refusal under test
        return f"{type(err).__name__}: {err}"
    return ""


def extension_layout_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Build an engine over a model whose parameters all have an all-gather extension, emulated: FSDP2's
    ``fsdp_pre_all_gather`` check answers yes, and FSDP2's own input builder stands for the extension's (same sizes).

    ``spec["oom_rank"]``: that rank runs out of GPU memory building the inputs (the error ``spec["oom_error"]``).
    Returns this rank's error text (``"error"``), the most parameters one call of the input builder got while the
    engine was built (``"most_params_per_call"``), and whether each group's layout matches FSDP2's metadata.
    """
    from odc_accelerate._compat.torch import fsdp as fsdp_compat
    from odc_accelerate.engine import ODCEngine
    from odc_accelerate.testing.models import ToyConfig, build_model, shard_model

    out = Path(spec["dir"])
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    model = shard_model(build_model(ToyConfig(), seed=0))
    fsdp_compat.lazy_init(model)
    groups = [g for _, state in fsdp_compat.all_states(model) for g in fsdp_compat.param_groups(state)]
    from_metadata = [fsdp_compat.all_gather_input_layout(g) for g in groups]  # before the emulation: no extension
    build = fsdp_compat._get_param_all_gather_inputs
    most = 0

    def build_inputs(fsdp_params: list[Any]) -> list[list[torch.Tensor]]:
        nonlocal most
        most = max(most, len(fsdp_params))
        if rank == spec.get("oom_rank"):
            raise _out_of_memory(spec["oom_error"])
        return build(fsdp_params=fsdp_params)

    fsdp_compat._has_extension = lambda p: True
    fsdp_compat._get_param_all_gather_inputs = build_inputs
    result: dict[str, Any] = {"error": ""}
    try:
        engine = ODCEngine(model, transport=CpuSegmentsCudaTransport(rank, world_size, timeout=60.0), timeout=60.0)
    except Exception as err:  # the refusal under test
        result["error"] = f"{type(err).__name__}: {err}"
    else:
        result["layouts_match"] = [(g.gather_numel, g.gather_dtype) for g in engine._groups] == from_metadata
        engine.close()
    result["most_params_per_call"] = most
    return result
