"""Functions the tests run on launched ranks, through `odc_accelerate.testing.launch` (one module per test area)."""
