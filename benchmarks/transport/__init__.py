"""``python -m benchmarks.transport``: read / accumulate bandwidth and latency per transport.

Two CPU processes on this machine (gloo on loopback). Rank 0 measures one-sided operations against rank 1, whose
training thread sits in a barrier the whole time (as an owner would be busy computing): ``shm`` (shared memory),
``network`` (TCP over loopback, owner-side service thread) and ``hierarchical`` with the two ranks claiming distinct
hosts (``ODC_HOST_ID``), i.e. its cross-host path. Every repeat measures every transport in turn (interleaved), the
table shows medians over repeats.

* read MB/s: ``read`` of a whole peer buffer (1 MiB and 16 MiB);
* accumulate MB/s: ``accumulate`` into the peer's buffer, timed up to the barrier that makes the adds visible (the
  network transport sends adds without waiting for them; the barrier waits until they are applied);
* latency us: one ``read`` / ``accumulate`` of a 64-byte buffer (median per call) and one two-rank ``barrier``.

The last line of output is JSON; the same object is written to ``results.json`` and the table to ``table.txt`` in
``--out`` (default: this folder, the stored results; ``python -m benchmarks.sim`` reads its shared-memory figures
from there). Modules: `workers` (what runs in the ranks), `cli` (runs them, tables, files).
"""

from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent
"""Stored results: ``RESULTS_DIR / "results.json"``."""
