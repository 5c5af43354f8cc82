"""``python -m benchmarks.sim [scale|validate|validate-e2e] [args]`` (see `benchmarks.sim`)."""

import sys

from benchmarks.sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
