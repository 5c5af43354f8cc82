"""Training scripts with ODC, the shape of TRL's ``trl/scripts``: one per trainer of
`odc_accelerate.trainers`.

Each takes every argument of TRL's script of the same name plus the ODC options, exposes ``make_parser()`` and
``main(script_args, training_args, model_args, dataset_args)``, and trains an offline default (a tiny Qwen2 model and
Python's own help text) when no model or dataset is named. Run them with ``odc-accelerate NAME``
(see `odc_accelerate.cli`), with ``accelerate launch -m odc_accelerate.scripts.sft``, or through the examples'
``train.py``.
"""
