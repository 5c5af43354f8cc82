"""``python -m benchmarks.engine [options]`` (see `benchmarks.engine`)."""

import sys

from benchmarks.engine.cli import main

if __name__ == "__main__":
    sys.exit(main())
