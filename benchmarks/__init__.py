"""Research tooling outside the wheel: benchmarks and the step-time simulator, each next to its stored results.

Run from the repository root (they need a source checkout: the end-to-end benchmark runs ``examples/``):

* ``python -m benchmarks.e2e <sft|dpo>``: the training examples end to end, FSDP2 arms against ODC (`benchmarks.e2e`);
* ``python -m benchmarks.grpo``: the GRPO example end to end, FSDP2 as TRL runs it against ODC (`benchmarks.grpo`);
* ``python -m benchmarks.engine``: ODC engine against FSDP2 on 2 CPU ranks;
* ``python -m benchmarks.transport``: read / accumulate bandwidth and latency per transport;
* ``python -m benchmarks.planning``: the step planners against random sampling and ``BatchRebalanceSampler``;
* ``python -m benchmarks.sim [scale|validate|validate-e2e]``: the step-time simulator and its validation against the
  stored results above.

They print and store figures, never assert them. ``odc_accelerate`` never imports this package.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
"""Root of the source checkout (benchmarks launch ``examples/`` from it)."""
