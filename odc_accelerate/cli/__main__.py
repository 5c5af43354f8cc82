"""``python -m odc_accelerate.cli``: the ``odc-accelerate`` command."""

import sys

from .main import main

sys.exit(main())
