#!/usr/bin/env bash
# Set up (if needed) and run the main job: the ODC engine benchmark on 2 CPU ranks.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
python -m odc_accelerate.bench engine "$@"
