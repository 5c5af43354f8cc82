#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: real 2- and 4-process gloo jobs on CPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
python -m pytest -q tests "$@"
