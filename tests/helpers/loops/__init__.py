"""Training loops and scripts the tests run as jobs: under ``accelerate launch`` or ``torchrun``, or as the one-process
references the parity tests compare with. Each runs as a script (or with ``python -m``) with the repository on
``PYTHONPATH``."""
