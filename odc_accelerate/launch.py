"""``odc-accelerate launch``: ``accelerate launch`` that honours ODC keys in the accelerate config file.

accelerate accepts unknown keys inside ``fsdp_config`` but never exports them to the worker processes. This
launcher reads the ODC keys from the config file's ``fsdp_config`` (``odc: true``, ``odc_transport: shm``,
``odc_plan: free``, ...: every option of `odc_accelerate.config.ODCConfig`, by its key), checks them, exports them
as their ``ODC_*`` environment variables (the launcher copies its environment into every worker), then runs
``accelerate launch`` with exactly the arguments it was given. Inside the workers, `ODCPlugin` and the ODC trainers
read those variables.

Usage::

    odc-accelerate launch --config_file examples/sft/configs/odc_cpu.yaml examples/sft/train.py --max_steps 3
    python -m odc_accelerate.launch launch --config_file cfg.yaml script.py ...

Values already set in the environment win over the file (so a one-off ``ODC_ENABLE=false`` works).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from collections.abc import Sequence

from .config import ODCConfig, env_from_fsdp_config

logger = logging.getLogger(__name__)


def _config_file(args: Sequence[str]) -> str | None:
    for i, a in enumerate(args):
        if a == "--config_file" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--config_file="):
            return a.split("=", 1)[1]
    return None


def odc_env_from_config(path: str) -> dict[str, str]:
    """The ``ODC_*`` variables asked for by the ODC keys of ``fsdp_config`` in an accelerate config file.

    Raises:
        ValueError: an unknown ``odc*`` key (with the known ones), an invalid value, or ``odc: true`` without
            ``distributed_type: FSDP`` and ``fsdp_version: 2``.
    """
    import yaml

    with open(path) as f:
        config = yaml.safe_load(f) or {}
    fsdp = config.get("fsdp_config") or {}
    try:
        env = env_from_fsdp_config(fsdp)
        resolved = ODCConfig.from_sources(fsdp_config=fsdp, env={})  # checks every value before any process starts
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    if resolved.enable and (config.get("distributed_type") != "FSDP" or int(fsdp.get("fsdp_version", 1)) != 2):
        raise ValueError(
            f"{path} asks for ODC (odc: true) but not FSDP2: set `distributed_type: FSDP` and, in fsdp_config, "
            "`fsdp_version: 2`. ODC does not run on FSDP1 or DDP."
        )
    return env


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``odc-accelerate``. Only the ``launch`` subcommand exists; it forwards to ``accelerate launch``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[0] != "launch":
        print(f"odc-accelerate: unknown command {argv[0]!r}; use `odc-accelerate launch ...`.", file=sys.stderr)
        return 2
    if importlib.util.find_spec("accelerate") is None or importlib.util.find_spec("yaml") is None:
        print(
            "odc-accelerate: `odc-accelerate launch` runs `accelerate launch`, which is not installed. Install the "
            "Hugging Face extra: pip install 'odc_accelerate[hf]'.",
            file=sys.stderr,
        )
        return 2
    rest = argv[1:]
    env = dict(os.environ)
    config = _config_file(rest)
    if config is None:
        # Like accelerate launch: fall back to the default config written by `accelerate config`.
        try:
            from accelerate.commands.config import default_config_file
        except ImportError:  # pragma: no cover - accelerate always has it in supported versions
            default_config_file = None
        if default_config_file and os.path.isfile(default_config_file):
            config = default_config_file
    if config is not None:
        try:
            exported = odc_env_from_config(config)
        except ValueError as err:
            print(f"odc-accelerate: {err}", file=sys.stderr)
            return 2
        for name, value in exported.items():
            env.setdefault(name, value)
        if exported:
            logger.info("Exported from %s: %s", config, ", ".join(f"{k}={env[k]}" for k in exported))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *rest]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
