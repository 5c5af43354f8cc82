"""``python -m odc_accelerate.launch launch ...``: the ``odc-accelerate`` command line, kept at this path.

The command line lives in `odc_accelerate.cli`; `odc_env_from_config` is
`odc_accelerate.cli.launch.odc_env_from_config`.
"""

import sys

from .cli.launch import odc_env_from_config
from .cli.main import main

__all__ = ["main", "odc_env_from_config"]

if __name__ == "__main__":
    sys.exit(main())
