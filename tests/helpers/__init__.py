"""What the tests run in real processes, with the tests and out of the wheel, by kind:

* ``workers/``: the functions the tests run on launched ranks (`odc_accelerate.testing.launch`);
* ``loops/``: training loops and scripts the tests run as jobs (``accelerate launch``, ``torchrun``, one process);
* ``infra/``: the harness around them: the warm-start server, network namespaces, ``torch.distributed`` call
  counting, the install tests' environment.

The GPU procedure is in ``tests/gpu``. Generic helpers that benchmarks share (`odc_accelerate.testing.launch`, the toy
models) stay in the package."""
