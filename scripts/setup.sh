#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install odc_accelerate with its test dependencies.
# VENV selects the environment folder (default .venv). Sourced by main.sh and test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip >/dev/null
# torch first and exact: 2.13.0 resolves to the CPU wheel this machine provides; a looser spec
# would pull the multi-GB CUDA build from the registry.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
