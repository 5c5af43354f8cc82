#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: real 2- and 4-process gloo jobs on CPU.
#
#   bash scripts/test.sh             # every test: the main environment (.venv), then the vLLM tests (tests/vllm) in
#                                    # their own environment (scripts/vllm_env.sh; ODC_TEST_VLLM=0 leaves them out)
#   bash scripts/test.sh ARGS...     # pytest ARGS in the main environment only
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
if [ $# -gt 0 ]; then
  exec python -m pytest -q tests "$@"
fi
# The vLLM tests skip here (no vLLM in this environment) and run in theirs, whose pins vLLM's CPU build sets.
python -m pytest -q tests --ignore=tests/vllm
if [ "${ODC_TEST_VLLM:-1}" != 0 ]; then
  bash scripts/vllm_env.sh tests/vllm
fi
