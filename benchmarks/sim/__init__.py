"""Step-time simulator for FSDP2 (per-layer lockstep) and ODC (one sync per step) under different samplers.

It lives in ``benchmarks/`` rather than in ``odc_accelerate`` because it is research tooling, validated against the
stored benchmark results, not something a training run imports.

``python -m benchmarks.sim [scale|hsdp|accumulate|ordered|validate|validate-e2e]``. Modules: `simulator` (the model:
`simulate`, `ModelSpec`, `Hardware`), `scale` (the at-scale table), `crossover` (the accumulate bandwidth at which ODC
overtakes FSDP2 on 8 H100s), `ordered` (the ordered gradient reduction beside the atomic one there), `calibrate` (live micro-measurements on this machine), `results` (the
stored benchmark results it is calibrated on and validated against), `replay` (replaying the end-to-end benchmark's
recorded steps), `validate` (both validations), `cli`.
"""

from benchmarks.sim.simulator import (
    H100,
    QWEN2_5_1_5B,
    QWEN2_5_7B,
    Hardware,
    ModelSpec,
    StepResult,
    collective_time,
    one_sided_time,
    plan_arrays,
    simulate,
)

__all__ = [
    "H100",
    "QWEN2_5_1_5B",
    "QWEN2_5_7B",
    "Hardware",
    "ModelSpec",
    "StepResult",
    "collective_time",
    "one_sided_time",
    "plan_arrays",
    "simulate",
]
