"""The environment every run of the end-to-end benchmark starts with.

One thread per process, ODC's collective timing on (``ODC_TIME_COLLECTIVES=1``), the source checkout first on
``PYTHONPATH``, none of the caller's ``ODC_*`` / ``ACCELERATE_*`` / ``FSDP_*`` settings, and the memory allocator.

Allocator: ``caching`` (default) sets glibc to keep freed blocks for reuse (``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_``). With glibc's defaults each block above 32 MiB is a fresh mmap that is page-faulted in at
first touch and unmapped at free, every microbatch; GPU training does not pay that (the CUDA caching allocator reuses
blocks), and on the examples' tiny model it is over half of the step time. ``system`` keeps glibc's defaults.
"""

from __future__ import annotations

import os
import platform

from benchmarks import REPO

CACHING_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}
ALLOCATORS = ("caching", "system")


def allocator_env(allocator: str) -> dict[str, str]:
    """The variables that select ``allocator`` for the runs (on glibc; elsewhere the system allocator runs as is)."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, got {allocator!r}")
    if allocator == "system" or platform.libc_ver()[0] != "glibc":
        return {}
    return dict(CACHING_MALLOC)


def run_env(allocator: str = "caching") -> dict[str, str]:
    """The environment of every process of a run (per-process variables, e.g. ``ODC_TRACE_DIR``, are added later)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith(("ODC_", "ACCELERATE_", "FSDP_")) or k in CACHING_MALLOC)
        or k in ("ODC_CACHE", "ODC_OFFLINE_BPE_RANKS")
    }
    env.update(allocator_env(allocator))
    path = env.get("PYTHONPATH")
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        ODC_TIME_COLLECTIVES="1",
        ODC_METRICS="per_rank",  # every arm logs each rank's busy and wait (plain FSDP2 arms too)
        PYTHONPATH=f"{REPO}{os.pathsep}{path}" if path else str(REPO),
    )
    return env
