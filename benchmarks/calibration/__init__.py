"""Calibration of the cost model on a GPU: measured forward + backward time of real model shapes per length.

``python -m benchmarks.calibration --device cuda --out DIR`` times Qwen2.5-0.5B and -1.5B shapes (random weights,
bf16, one sequence per step) at lengths 256..32768, fits ``time = c + a L + b L^2`` and writes
``DIR/calibration.json`` and ``DIR/summary.txt``. `load_calibration` reads a model's fit back as the planner's
`QuadraticCost` (in seconds); ``python -m benchmarks.sim scale --calibration DIR/calibration.json`` uses it in
place of the assumed GPU compute figures.

Modules: `configs` (model shapes), `measure` (the timing process, torch), `fit` (the least-squares fit),
`load` (reading a file back), `cli`. Importing this package imports neither torch nor transformers.
"""

from benchmarks.calibration.configs import DEFAULT_LENGTHS, DEFAULT_MODELS, MODEL_CONFIGS
from benchmarks.calibration.fit import QuadraticFit, fit_quadratic
from benchmarks.calibration.load import (
    CalibratedCost,
    CalibrationError,
    calibrated_models,
    load_calibration,
    read_calibration,
)

__all__ = [
    "DEFAULT_LENGTHS",
    "DEFAULT_MODELS",
    "MODEL_CONFIGS",
    "CalibratedCost",
    "CalibrationError",
    "QuadraticFit",
    "calibrated_models",
    "fit_quadratic",
    "load_calibration",
    "read_calibration",
]
