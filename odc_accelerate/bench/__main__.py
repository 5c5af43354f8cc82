"""Dispatch ``python -m odc_accelerate.bench <name> [args]`` to ``odc_accelerate.bench.<name>.main``."""

import sys
from importlib import import_module

BENCHMARKS = {
    "engine": "ODC engine vs FSDP2 on 2 CPU ranks (balanced / 4:1 imbalanced)",
    "transport": "read / accumulate bandwidth and latency per transport (shm, network, hierarchical)",
    "balance": "step planners vs random / BatchRebalanceSampler on long-tailed lengths",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHMARKS:
        listing = "\n".join(f"  {name:8s} {text}" for name, text in BENCHMARKS.items())
        print(f"usage: python -m odc_accelerate.bench <name> [args]\n\nbenchmarks:\n{listing}", file=sys.stderr)
        return 2
    module = import_module(f"odc_accelerate.bench.{argv[0]}")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
