"""Runs a training script unchanged in this process, then records the process's peak RSS (end-to-end benchmark).

``accelerate launch -m odc_accelerate.bench._e2e_worker examples/sft/train.py ARGS`` (or ``python -m ...``) executes
the script as ``__main__`` with ``ARGS`` (as ``python script ARGS`` would) and, when it ends, even on an error, writes
``$ODC_BENCH_RSS_DIR/rss_rank<RANK>.json`` with ``ru_maxrss`` of this process: peak resident memory, including the
shared-memory pages the process touched (ODC's ``/dev/shm`` segments count in every rank that maps them).
"""

from __future__ import annotations

import json
import os
import resource
import runpy
import sys


def _write_rss(directory: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"rss_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "pid": os.getpid(), "peak_rss_mb": round(peak_mb, 1)}, f)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m odc_accelerate.bench._e2e_worker SCRIPT [ARGS...]")
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    sys.path[0] = os.path.dirname(script)  # as `python script` sets it
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        directory = os.environ.get("ODC_BENCH_RSS_DIR")
        if directory:
            _write_rss(directory)


if __name__ == "__main__":
    main()
