"""Integrations of ODC with accelerate (`accelerate`), the transformers Trainer (`trainer`) and TRL (`trl`).

Import the submodule you need; each imports its library and none patches anything on import (accelerate is patched
by the explicit, idempotent `odc_accelerate.integrations.accelerate.enable`).
"""
