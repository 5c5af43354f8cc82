#!/usr/bin/env bash
# Test odc_accelerate on one torch release (and the Hugging Face releases that go with it) in an environment of its
# own, next to CI's single one (torch 2.13, scripts/test.sh).
#
#   bash scripts/compat.sh 2.11.0 --hf-previous   # torch 2.11.0 + the oldest supported transformers 5.17,
#                                                 # accelerate 1.14 and TRL 1.15
#   bash scripts/compat.sh 2.14.1                 # torch 2.14.1 + the newest releases the hf extra allows
#   bash scripts/compat.sh 2.12.1 -x -k parity    # more arguments go to pytest
#
# It builds (or reuses) $COMPAT_VENVS/torch-VERSION[-hf-previous] (default ~/.cache/odc_accelerate/compat; a CUDA
# build of torch takes ~5 GB and runs on CPU), installs torch==VERSION first and odc_accelerate with the hf, peft,
# demo and testing extras around it (pip keeps that torch), prints the versions, and runs the tests that depend on
# torch's and the Hugging Face libraries' internals: the unit tests, the engine's multi-process tests, and a few
# integration runs of the SFT and DPO examples (with --hf-previous, every SFT and DPO integration test: the TRL
# differs from CI's).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
  echo "usage: bash scripts/compat.sh TORCH_VERSION [--hf-previous] [pytest arguments...]" >&2
  exit 2
fi
VERSION="$1"
shift
HF_PREVIOUS=0
if [ "${1:-}" = "--hf-previous" ]; then
  HF_PREVIOUS=1
  shift
fi

ROOT="${COMPAT_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/odc_accelerate/compat}"
VENV="$ROOT/torch-$VERSION"
[ "$HF_PREVIOUS" = 1 ] && VENV="$VENV-hf-previous"
mkdir -p "$ROOT"
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# Pins for this environment: the torch under test, and with --hf-previous the oldest supported Hugging Face releases
# (transformers 5.17, the release that went with torch 2.11-2.12; accelerate 1.14; TRL 1.15). Everything else
# resolves from pyproject.toml's ranges.
CONSTRAINTS="$VENV/odc-constraints.txt"
{
  echo "torch==$VERSION"
  if [ "$HF_PREVIOUS" = 1 ]; then
    echo "transformers==5.17.*"
    echo "accelerate==1.14.*"
    echo "trl==1.15.*"
  fi
} >"$CONSTRAINTS"
# These pins replace, for this environment's pip calls only, any constraints from pip's configuration: a machine may
# cap torch below the release under test (e.g. a pip.conf `constraint` holding "torch<=2.14.1" that keeps installs on
# the wheels it has on disk), and pip would then refuse torch==VERSION (2.15.0 and newer). PIP_CONSTRAINT takes
# precedence over the configuration files, which stay untouched; torch is pinned exactly here anyway.
export PIP_CONSTRAINT="$CONSTRAINTS"
"$PY" -m pip install -q --upgrade pip >/dev/null
"$PY" -m pip install -q "torch==$VERSION"
"$PY" -m pip install -q -e ".[hf,peft,demo,testing]"
"$PY" - <<'EOF'
import importlib
for name in ("torch", "transformers", "accelerate", "trl", "peft", "datasets"):
    print(f"{name} {importlib.import_module(name).__version__}")
EOF

TESTS=(
  tests/unit
  tests/multiprocess/test_engine_parity.py
  tests/multiprocess/test_engine_failures.py
  tests/multiprocess/test_engine_frozen.py
  tests/multiprocess/test_engine_unused_params.py
)
if [ "$HF_PREVIOUS" = 1 ]; then
  # Another TRL than CI's, whose fused LM head takes odc_accelerate's torch path on CPU: every SFT and DPO run (exact
  # losses against one process and plain FSDP2, metrics, checkpoints, PEFT, precomputed reference log-probs).
  TESTS+=(tests/multiprocess/test_integration_sft.py tests/multiprocess/test_integration_dpo.py)
else
  # The bf16 SFT run against plain FSDP2 (bit-identical), and the set-up errors of SFT and DPO (each builds the
  # trainer, accelerate's FSDP2 plugin and the ODC engine's checks before it refuses).
  TESTS+=(
    tests/multiprocess/test_integration_sft.py::test_bf16_odc_bit_identical_to_plain_fsdp2
    tests/multiprocess/test_integration_sft.py::test_bad_config_fails_before_training
    tests/multiprocess/test_integration_dpo.py::test_bad_dpo_config_fails_before_training
  )
fi
exec "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" "$@"
