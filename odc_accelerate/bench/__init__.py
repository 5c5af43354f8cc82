"""Benchmarks: ``python -m odc_accelerate.bench <engine|balance>``. They print figures, never assert times."""
