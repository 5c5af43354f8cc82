"""``python -m benchmarks.engine``: ODC vs FSDP2 step time and memory on 2 CPU ranks.

Arms (one thread per rank; all four live in the same pair of processes and run interleaved step by
step, rotating the order, so that machine noise hits every arm alike):

* ``fsdp``: FSDP2 with its gloo all-gather / reduce-scatter;
* ``odc``: the same model through :class:`~odc_accelerate.ODCEngine` (shared-memory transport);
* ``odc_layersync``: ODC with a barrier inside every hook: same data path, FSDP2's per-layer sync;
* ``limit``: each rank trains an unsharded local copy with no communication at all (the physical
  limit of a step is the mean per-rank compute).

Workloads, same sequences per rank and step in both, so per-rank totals are identical:

* balanced: both ranks run ``[long, short]`` (every microbatch slot matched);
* imbalanced: rank 0 runs ``[long, short]``, rank 1 ``[short, long]`` (4:1 per slot at the default).

Step time = first microbatch to end of the optimizer step, between two barriers; medians over the
measured steps (warm-up steps dropped). Peak memory comes from separate process pairs that run one
arm each (peak RSS cannot be split between arms of one process): max over ranks of the process peak
RSS, where shared-memory pages a rank maps count in its RSS.

Prints a table and, last, the summary as one JSON line; writes ``results.json`` (that summary) and ``table.txt`` into
``--out`` (default: this folder, the stored results that ``python -m benchmarks.sim validate`` predicts).
Modules: `workers` (what runs in the ranks), `cli` (runs them, tables, files).
"""

from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent
"""Stored results: ``RESULTS_DIR / "results.json"``."""
