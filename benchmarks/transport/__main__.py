"""``python -m benchmarks.transport [options]`` (see `benchmarks.transport`)."""

import sys

from benchmarks.transport.cli import main

if __name__ == "__main__":
    sys.exit(main())
