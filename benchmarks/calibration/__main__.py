"""``python -m benchmarks.calibration --device cuda --out DIR`` (see `benchmarks.calibration`)."""

import sys

from benchmarks.calibration.cli import main

if __name__ == "__main__":
    sys.exit(main())
