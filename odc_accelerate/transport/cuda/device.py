"""This rank's device facts for the ``"cuda"`` transport, gathered from every rank, and the accumulate path they
decide.

The facts (`local_device_facts`, `gather_device_facts`) are what `.segments.device_refusal` and `.segments.memory_refusal`
judge on every rank alike, so that all ranks refuse together before any of them enters a collective with no timeout.
They carry whether this rank could compile and launch the accumulate kernel (`local_accumulate_kernel`), so that
every rank takes the same accumulate path (`choose_accumulate_path`).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ... import memory_spec
from ..base import BufferSpec, host_id
from .kernels import kernel_available, probe
from .segments import OVERLAP_ENV, DeviceFacts, accumulate_kernel_agreement, accumulator_dtype

logger = logging.getLogger(__name__)

_P2P_NATIVE_ATOMIC = 3  # CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED (cudaDevP2PAttrNativeAtomicSupported)
#: the accumulate paths: the Triton kernel (`.kernels.accumulate_`), or ``index_add_`` through the staging pool
KERNEL_PATH, FALLBACK_PATH = "kernel", "index_add_"
_said: set[tuple[str, str]] = set()  # accumulate paths already logged by this process


def local_accumulate_kernel(
    device: torch.device,
    accumulated: Sequence[BufferSpec],
    accumulate_dtype: torch.dtype | None = None,
    enabled: bool = True,
) -> tuple[bool, str]:
    """Whether this rank can add ``accumulated`` buffers with the accumulate kernel, and why (not); no collective.

    `.kernels.kernel_available` first (it compiles nothing), then `.kernels.probe`, which compiles the kernel for
    every source dtype and launches it on a scratch area: a Triton that cannot compile or launch shows here, at
    set-up, instead of in the first backward pass. A failed probe is logged at WARNING on this rank.
    """
    if not accumulated:
        return False, "nothing is accumulated"
    if not enabled:
        return False, "accumulate_kernel=False"
    try:
        dtype = accumulator_dtype(accumulated[0].dtype, accumulate_dtype)
    except ValueError as err:  # `plan_segment` raises it on every rank once the facts are gathered
        return False, str(err)
    ok, why = kernel_available(device, dtype)
    if not ok:
        return False, why
    problem = probe(device, dtype, sorted({spec.dtype for spec in accumulated}, key=str))
    if problem is not None:
        logger.warning("cuda transport: %s; every rank will add gradients with index_add_", problem)
        return False, problem
    return True, why


def choose_accumulate_path(facts: Sequence[DeviceFacts]) -> tuple[str, str]:
    """The accumulate path every rank takes, decided from every rank's gathered facts, and why; logged once per
    process.

    The kernel where it passed `local_accumulate_kernel` on every rank (`.segments.accumulate_kernel_agreement`),
    else the ``index_add_`` fallback (logged at WARNING: it moves about twice the bytes per element, needs the staging
    pool, and its atomics are of device scope, which the 'cuda' transport relies on NVLink to perform at the owner for
    adds arriving from peers).
    """
    ok, why = accumulate_kernel_agreement(facts)
    path = KERNEL_PATH if ok else FALLBACK_PATH
    if (path, why) not in _said:
        _said.add((path, why))
        if ok:
            logger.info("cuda transport: gradients accumulate with the Triton kernel (%s)", why)
        else:
            logger.warning(
                "cuda transport: gradients accumulate with index_add_ through a staging pool, the slower fallback "
                "with device-scope atomics, because %s",
                why,
            )
    return path, why


def cuda_unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why the CUDA transport cannot run in this process (a sentence naming what is missing), or None if it can.

    Local checks only (torch build, driver, torch's symmetric memory); `gather_device_facts` adds the checks that need
    every rank.
    """
    if device is not None and torch.device(device).type != "cuda":
        return f"the model is on {torch.device(device).type}, not cuda"
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support; install a CUDA build of torch"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False: no usable GPU or driver"
    from ..._compat.torch import symm_mem as compat  # imported here: the CPU transports need no FSDP2 internals

    return compat.symmetric_memory_unavailable_reason()


def _p2p_native_atomics(src: int, dst: int) -> bool | None:
    """Whether device ``src`` has native atomics into device ``dst``'s memory (CUDA driver), None if unknown."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        a, b, value = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(a), src) or lib.cuDeviceGet(ctypes.byref(b), dst):
            return None
        if lib.cuDeviceGetP2PAttribute(ctypes.byref(value), _P2P_NATIVE_ATOMIC, a, b):
            return None
        return bool(value.value)
    except (OSError, AttributeError):
        return None


def local_device_facts(device: torch.device | None, settings: tuple = ()) -> DeviceFacts:
    """This rank's `DeviceFacts` (no collective; a problem found here is carried in ``problem``, not raised)."""
    problem = cuda_unavailable_reason(device or torch.device("cuda"))
    common = dict(
        host=host_id(),
        settings=settings,
        allow_overlap=os.environ.get(OVERLAP_ENV) == "1",
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )
    if problem:
        return DeviceFacts(problem=problem, **common)
    from ..._compat.torch import symm_mem as compat

    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    visible = tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(count))
    access = tuple(i == index or torch.cuda.can_device_access_peer(index, i) for i in range(count))
    atomics = tuple(True if i == index else _p2p_native_atomics(index, i) for i in range(count))
    # The segment comes from cuMemCreate, which cannot reuse blocks PyTorch's caching allocator holds unused: they are
    # given back first, so that the free figure is what the allocation can get (a loaded model leaves many behind).
    free, _ = memory_spec.free_and_total(torch.device("cuda", index), release_cache=True)
    return DeviceFacts(
        uuid=visible[index],
        visible=visible,
        access=access,
        atomics=atomics,
        backend=compat.symmetric_backend(torch.device("cuda", index)),
        free_bytes=int(free),
        **common,
    )


def gather_device_facts(
    group: dist.ProcessGroup | None,
    world_size: int,
    device: torch.device,
    settings: tuple = (),
    *,
    local: DeviceFacts | None = None,
) -> list[DeviceFacts]:
    """Collective over ``group``: every rank's `DeviceFacts`, indexed by rank (this rank's are ``local`` if given,
    else `local_device_facts`)."""
    facts: list[DeviceFacts] = [None] * world_size  # type: ignore[list-item]
    dist.all_gather_object(facts, local or local_device_facts(device, settings), group=group)
    return facts
