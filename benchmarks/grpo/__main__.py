"""``python -m benchmarks.grpo [options] [-- script args]`` (see `benchmarks.grpo`)."""

import sys

from benchmarks.grpo.cli import main

if __name__ == "__main__":
    sys.exit(main())
