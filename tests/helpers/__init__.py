"""Test bodies run in real processes: per-rank workers, loop scripts launched by ``accelerate launch``, the network
namespace harness and the GPU checker. Generic helpers that benchmarks share (`odc_accelerate.testing.launch`, the toy
models) stay in the package; these stay with the tests, out of the wheel."""
