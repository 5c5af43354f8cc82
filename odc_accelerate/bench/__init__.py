"""Benchmarks: ``python -m odc_accelerate.bench <engine|transport|balance|sft|dpo>``. They print figures, never
assert times."""
