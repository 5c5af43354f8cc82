"""Process exit with ODC engines: free destroyed process groups while gloo can still join its worker threads.

gloo joins its worker threads only when a process group object is freed, and ``destroy_process_group()`` does not
free it while FSDP2 modules, their device meshes or an engine still reference it. A worker still running while the
interpreter finalises can abort a finished run (``terminate called without an active exception``): a custom loop
that ends with ``engine.close(); dist.destroy_process_group()`` and keeps its model in a global would fail at exit.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Protocol

import torch.distributed as dist

from .._compat import CompatError
from .._compat.torch import c10d as compat

__all__ = ["release_destroyed_groups", "release_process_groups_at_exit", "watch"]

logger = logging.getLogger(__name__)


class _Closeable(Protocol):
    """What the exit handler needs of an engine (`odc_accelerate.ODCEngine`): a ``close`` that frees its transport."""

    def close(self) -> None: ...


_LIVE_ENGINES: weakref.WeakSet[_Closeable] = weakref.WeakSet()  # weak: the exit handler keeps no engine alive
_exit_handler_registered = False


def watch(engine: _Closeable) -> None:
    """Track ``engine`` and register `release_process_groups_at_exit` (once per process)."""
    global _exit_handler_registered
    _LIVE_ENGINES.add(engine)
    if not _exit_handler_registered:
        atexit.register(release_process_groups_at_exit)
        _exit_handler_registered = True


def _default_group_destroyed() -> bool:
    return dist.is_available() and not dist.is_initialized()


def release_destroyed_groups() -> int:
    """Once ``dist.destroy_process_group()`` has run, drop every reference FSDP2 modules keep to process groups.

    That frees the groups, so gloo joins its worker threads now. Does nothing while the default process group exists
    (the model may still be trained with FSDP2); once it is destroyed no FSDP2 module of this process can communicate
    anyway. A missing torch internal is logged, not raised: training is over.

    Returns:
        `int`: how many references to process groups were dropped.
    """
    if not _default_group_destroyed():
        return 0
    try:
        dropped = compat.release_process_groups([])
    except CompatError as err:
        logger.warning(
            "%s Without it gloo's worker threads may outlive destroy_process_group (rare abort at exit).", err
        )
        return 0
    logger.debug("Released %d references to destroyed process groups.", dropped)
    return dropped


def release_process_groups_at_exit() -> None:
    """Exit handler: if the default group was destroyed, close the engines left open and release the groups.

    Runs before the interpreter finalises, while gloo can still join its threads. Holds no engine or model: a live
    engine is found through `_LIVE_ENGINES`, a live FSDP2 module through torch's registry of module states.
    """
    if not _default_group_destroyed():
        return
    for engine in list(_LIVE_ENGINES):
        try:
            engine.close()  # an engine left open: its transport goes (nothing can use it without the group)
        except Exception as err:  # best effort at exit: report, and still release the rest
            logger.warning("Closing an ODCEngine at exit failed: %s", err)
    release_destroyed_groups()
