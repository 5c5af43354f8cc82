"""``python -m benchmarks.e2e <sft|dpo> [options] [-- script args]`` (see `benchmarks.e2e`)."""

import sys

from benchmarks.e2e.cli import main

if __name__ == "__main__":
    sys.exit(main())
