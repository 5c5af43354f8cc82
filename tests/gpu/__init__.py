"""The GPU procedure: ``bash scripts/gpu_session.sh OUT`` (every case) and ``bash scripts/gpu_check.sh OUT`` (the
engine-level cases), run on a machine with one GPU; ``--device cpu`` is the dry run. See README.md here. None of these
modules is a test module: the tests of the procedure's logic are in ``tests/unit`` and its dry run in
``tests/multiprocess/test_gpu_session_on_cpu.py``."""
