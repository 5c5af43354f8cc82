# Copyright 2026 The odc_accelerate authors. Derived from TRL's trl/scripts/distillation.py (Apache-2.0).
"""On-policy distillation with ODC: a drop-in for TRL's ``trl/scripts/distillation.py`` plus the ODC arguments.

The script is `odc_accelerate.scripts.distillation` (also ``odc-accelerate distillation``): every argument of TRL's
script, the ODC ones (``--odc``, ``--odc_plan``, ...), and an offline default without ``--model_name_or_path`` /
``--dataset_name`` (see README.md beside this file).

    accelerate launch --config_file examples/distillation/configs/odc_cpu.yaml examples/distillation/train.py \
        --odc true --max_steps 3 --logging_steps 1 --output_dir OUT
"""

from odc_accelerate.scripts.distillation import main, make_parser

if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(fail_with_unknown_args=False)
    main(script_args, training_args, model_args, dataset_args, given=parser.given)
