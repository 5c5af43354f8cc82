"""Dispatch ``python -m odc_accelerate.bench <name> [args]`` to ``odc_accelerate.bench.<name>.main``."""

import sys
from importlib import import_module

BENCHMARKS = {
    "engine": "ODC engine vs FSDP2 on 2 CPU ranks (balanced / 4:1 imbalanced)",
    "transport": "read / accumulate bandwidth and latency per transport (shm, network, hierarchical)",
    "balance": "step planners vs random / BatchRebalanceSampler on long-tailed lengths",
    "sft": "examples/sft/train.py end to end: FSDP2 + random / batch_rebalance / lockstep plan vs ODC + plan",
    "dpo": "examples/dpo/train.py end to end: the same arms as sft",
}
# End-to-end benchmarks share one module (odc_accelerate/bench/e2e.py, WORKLOADS) and receive their name first.
END_TO_END = {"sft": "e2e", "dpo": "e2e"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHMARKS:
        listing = "\n".join(f"  {name:9s} {text}" for name, text in BENCHMARKS.items())
        print(f"usage: python -m odc_accelerate.bench <name> [args]\n\nbenchmarks:\n{listing}", file=sys.stderr)
        return 2
    name = argv[0]
    module = import_module(f"odc_accelerate.bench.{END_TO_END.get(name, name)}")
    return int(module.main(argv if name in END_TO_END else argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
