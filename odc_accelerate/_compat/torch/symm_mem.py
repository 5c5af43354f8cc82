"""torch's private symmetric memory, which the CUDA transport allocates its segments in and maps its peers' through.

Imported on its own (the launcher reads `MULTICAST_OFF_ENV` from it), it loads no FSDP2 internal.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

import torch

from .. import CompatError
from . import _check_signature, _import, _require

_SYMM = "torch.distributed._symmetric_memory"
#: torch's switch that keeps a symmetric-memory rendezvous from binding NVLS multicast (ODC never uses it)
MULTICAST_OFF_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"


def _symmetric_memory() -> Any:
    """torch's ``_SymmetricMemory`` class, with every method the CUDA transport calls checked."""
    _check_signature(_import(_SYMM, "rendezvous"), ("tensor", "group"), f"{_SYMM}.rendezvous")
    handle_type = _import(_SYMM, "_SymmetricMemory")
    where = f"{_SYMM}._SymmetricMemory"
    empty_p2p = _require(handle_type, "empty_strided_p2p", where)
    get_buffer = _require(handle_type, "get_buffer", where)
    _check_signature(empty_p2p, ("size", "stride", "dtype", "device", "group_name"), f"{where}.empty_strided_p2p")
    _check_signature(get_buffer, ("rank", "sizes", "dtype", "storage_offset"), f"{where}.get_buffer")
    return handle_type


def symmetric_memory_unavailable_reason() -> str | None:
    """Why this torch's symmetric memory cannot serve the CUDA transport (a sentence naming what is missing), or
    None if it can. Does not touch a GPU."""
    try:
        _symmetric_memory()
    except CompatError as err:
        return str(err).rstrip(".")  # callers embed it in a sentence
    return None


def symmetric_signal_pad_bytes() -> int | None:
    """The signal pad torch's symmetric memory allocates with each segment (``get_signal_pad_size``), or `None` where
    this torch does not say (the caller then counts an upper bound)."""
    get_size = getattr(importlib.import_module(_SYMM), "get_signal_pad_size", None)
    return int(get_size()) if callable(get_size) else None


def symmetric_backend(device: torch.device) -> str:
    """The symmetric-memory backend this process allocates with on ``device`` (``"CUDA"``, ``"NCCL"``, ...).

    Both torch's answer (``get_backend``, set by ``set_backend`` or FSDP2's ``set_symm_mem``; absent on some releases)
    and ``$TORCH_SYMMMEM`` (read when the first block is allocated) are consulted; whichever names a backend other than
    CUDA wins, so that a refusal errs on the safe side. torch's default is CUDA.
    """
    get_backend = getattr(_symmetric_memory(), "get_backend", None)
    named = [get_backend(device) if get_backend is not None else None, os.environ.get("TORCH_SYMMMEM")]
    others = [str(b) for b in named if b and str(b).upper() != "CUDA"]
    return others[0] if others else "CUDA"


def _without_multicast(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with NVLS multicast disabled for symmetric memory (torch reads the switch at allocation and
    rendezvous).

    The variable is written at most once per process and left set: by now NCCL and gloo threads run and may call
    ``getenv``, and a ``setenv`` racing them is undefined behaviour in glibc, so writing it again to restore the old
    value would double that risk. When it is already ``1`` (e.g. set by the launcher), nothing is written.
    """
    if os.environ.get(MULTICAST_OFF_ENV) != "1":
        os.environ[MULTICAST_OFF_ENV] = "1"
    return fn()


def symmetric_segment(nbytes: int, device: torch.device, group: Any) -> torch.Tensor:
    """A 1-D uint8 tensor of ``nbytes`` in symmetric memory on ``device`` for ``group`` (whose ranks then call
    `symmetric_rendezvous` with it).

    Allocated directly (``empty_strided_p2p``), not through ``_symmetric_memory.empty``: in recent releases (2.13
    checked) ``empty`` allocates from a per-device memory pool that keeps freed blocks cached, so the segment would
    outlive the transport. Allocated directly, it goes back to the driver when its last view dies.
    """
    handle_type = _symmetric_memory()
    group_name = group if isinstance(group, str) else group.group_name  # required by some releases, harmless in others
    return _without_multicast(
        lambda: handle_type.empty_strided_p2p(
            size=(nbytes,), stride=(1,), dtype=torch.uint8, device=device, group_name=group_name
        )
    )


def symmetric_rendezvous(segment: torch.Tensor, group: Any) -> Any:
    """Collective: exchange the ``segment`` handles of every rank of ``group``; returns the handle for peer views.

    Multicast is not bound (ODC reads and adds peer to peer only; binding NVLS for a large segment costs set-up time
    and multicast memory).
    """
    _symmetric_memory()
    rendezvous = _import(_SYMM, "rendezvous")  # the module function: it does whatever set-up this release needs
    return _without_multicast(lambda: rendezvous(tensor=segment, group=group))


def peer_segment(handle: Any, peer: int, nbytes: int) -> torch.Tensor:
    """``peer``'s segment (``nbytes`` uint8 bytes), mapped into this process by a `symmetric_rendezvous` handle."""
    return handle.get_buffer(rank=peer, sizes=(nbytes,), dtype=torch.uint8, storage_offset=0)
