#!/usr/bin/env bash
# One-command check of the 'cuda' ODC transport on a machine with one (or more) NVIDIA GPU(s):
#   scripts/gpu_check.sh [OUT_DIR]          (default OUT_DIR: /tmp/odc_gpu_check)
# Two processes share GPU 0 over a gloo process group (8 in ranks8). Cases: refusals, parity against one process,
# 8 ranks (parity, the dynamic plan's claims, 7 ranks adding into one owner's shard), the memory report and close(), a
# small speed figure. Writes OUT_DIR/results.json and OUT_DIR/summary.txt; exits non-zero if a check fails. Needs
# torch with CUDA, numpy, and this repository on PYTHONPATH (no network, no trl or datasets).
# Extra arguments after OUT_DIR go to the checker, e.g. --cases parity,memory.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-/tmp/odc_gpu_check}"
shift || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Two ranks on one GPU: torch's symmetric memory refuses that without this switch (the refusal case unsets it).
export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
# Symmetric memory's rendezvous opens a Unix socket under TMPDIR: keep the path short and shared by both ranks.
export TMPDIR="${TMPDIR:-/tmp}"
# python3 first: the GPU machines have no `python`.
python="${PYTHON:-$(command -v python3 || command -v python)}"
exec "$python" -c 'import sys; from tests.gpu.gpu_check import main; sys.exit(main(sys.argv[1:]))' \
  --out "$out" "$@"
