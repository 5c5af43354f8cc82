"""``odc-accelerate launch``: ``accelerate launch`` that honours the ODC keys of the accelerate config file.

accelerate never exports unknown ``fsdp_config`` keys to the workers, so this launcher reads and checks the ODC keys
there, exports them as their ``ODC_*`` variables (values already in the environment win), then runs ``accelerate
launch``. Every script starts through `odc_accelerate.cli.bootstrap`: with the ODC trainers when the run asks for ODC
(config file, environment, recipe or ``--odc true``; the script's arguments win), else with ``--no-odc`` (plain
FSDP2, over gloo on CPU). See docs/integrations.md, "The command line".
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence

from ..config import ODCConfig, env_from_fsdp_config
from ..recipe import odc_flag_value, read_recipe, recipe_path
from ..trainers import REFUSED_TRAINERS, SERVED_TRAINERS
from ..validation import str_to_bool

__all__ = [
    "ACCELERATE_MISSING",
    "HELP",
    "accelerate_missing",
    "config_file_of",
    "launch",
    "odc_env_from_config",
    "split_launch_args",
    "through_bootstrap",
]

BOOTSTRAP = "odc_accelerate.cli.bootstrap"
NO_ODC = "--no-odc"  # the bootstrap's flag: plain FSDP2 (the package's accelerate patches, no ODC trainer)

_ABOUT = textwrap.fill(
    "`accelerate launch` that honours the ODC keys of the accelerate config file's fsdp_config (odc, odc_transport, "
    "odc_plan, ...): they are checked, exported to the workers as ODC_* variables, and, when the run asks for ODC, "
    "the script starts through `python -m odc_accelerate.cli.bootstrap`, which replaces TRL's "
    + ", ".join(f"{t.trl_config}/{t.trl_trainer}" for t in SERVED_TRAINERS)
    + " with the ODC ones (TRL's own trl/scripts/*.py train with ODC) and stops, before training, a Trainer that is "
    "not an ODC trainer ("
    + ", ".join(t.trl_trainer for t in REFUSED_TRAINERS)
    + " with the reason ODC refuses them).",
    width=116,
)
HELP = f"""usage: odc-accelerate launch [accelerate launch arguments] SCRIPT [script arguments]

{_ABOUT}

    odc-accelerate launch --config_file cfg.yaml train.py --max_steps 3

The arguments of `accelerate launch` follow."""


def accelerate_missing() -> bool:
    """Whether ``accelerate launch`` cannot run here (accelerate or PyYAML missing)."""
    return importlib.util.find_spec("accelerate") is None or importlib.util.find_spec("yaml") is None


ACCELERATE_MISSING = (
    "odc-accelerate runs `accelerate launch`, which is not installed. Install the Hugging Face extra: "
    "pip install 'odc_accelerate[hf]'."
)


def config_file_of(args: Sequence[str]) -> str | None:
    """The accelerate config file named by ``--config_file`` in ``args``, else accelerate's default config file if
    it exists (as ``accelerate launch`` does), else None."""
    for i, a in enumerate(args):
        if a == "--config_file" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--config_file="):
            return a.split("=", 1)[1]
    from .._compat.accelerate import default_config_file

    path = default_config_file()
    return path if os.path.isfile(path) else None


def odc_env_from_config(path: str) -> dict[str, str]:
    """The ``ODC_*`` variables asked for by the ODC keys of ``fsdp_config`` in an accelerate config file.

    Raises:
        ValueError: an unknown ``odc*`` key (with the known ones), an invalid value, or ``odc: true`` without
            ``distributed_type: FSDP`` and ``fsdp_version: 2``.
    """
    import yaml

    with open(path, encoding="utf-8") as f:
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


def split_launch_args(args: Sequence[str]) -> tuple[list[str], str, list[str], bool, bool]:
    """Split ``accelerate launch`` arguments with accelerate's own parser.

    Returns:
        ``(launch_args, script, script_args, module, no_python)``: the arguments before the training script, the
        script (a module name with ``--module``), its arguments, and accelerate's ``--module`` / ``--no_python``.
    """
    from .._compat.accelerate import launch_parser

    args = list(args)
    parsed = launch_parser().parse_args(args)
    script_args = list(parsed.training_script_args)
    at = len(args) - len(script_args) - 1
    if at < 0 or args[at] != parsed.training_script:  # pragma: no cover - argparse keeps REMAINDER at the end
        raise ValueError(f"Could not find the training script {parsed.training_script!r} in the launch arguments.")
    return args[:at], parsed.training_script, script_args, bool(parsed.module), bool(parsed.no_python)


def through_bootstrap(
    launch_args: Sequence[str], script: str, script_args: Sequence[str], module: bool, *, odc: bool = True
) -> list[str]:
    """``accelerate launch`` arguments that start ``script`` (a module name if ``module``) through the bootstrap;
    without ``odc``, the bootstrap installs the package's accelerate patches only (``--no-odc``)."""
    head = list(launch_args)
    if not module:
        head.append("--module")
    target = ["-m", script] if module else [script]
    return [*head, BOOTSTRAP, *([] if odc else [NO_ODC]), *target, *script_args]


def _odc_requested(env: Mapping[str, str], script_args: Sequence[str]) -> bool:
    # The script's arguments win over its recipe, which wins over the config file and the environment, as they do
    # when the ODC training arguments resolve the options.
    path = recipe_path(script_args)
    recipe = read_recipe(path) if path is not None else None  # raises on a misspelt odc* key
    flag = odc_flag_value(script_args)
    if flag is not None:
        return flag
    if recipe is not None and recipe.get("odc") is not None:
        return str_to_bool(recipe["odc"], f"odc in the recipe {path}")
    return ODCConfig.from_sources(env=env).enable


def launch(args: Sequence[str], *, bootstrap: bool | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run ``accelerate launch ARGS`` with the config file's ODC keys exported; returns its exit status.

    Args:
        args (`Sequence[str]`): the arguments of ``accelerate launch`` (its options, the script, the script's ones).
        bootstrap (`bool`, *optional*): start the script through `odc_accelerate.cli.bootstrap` (`False`: as given);
            by default, with ODC when the run asks for it and with ``--no-odc`` (plain FSDP2) otherwise, unless the
            script is not Python (``--no_python``).
        env (`Mapping[str, str]`, *optional*, defaults to `os.environ`): the environment to start from.

    Raises:
        ValueError: an invalid ODC key or value in the config file, the environment or the script's recipe, or ODC
            asked for with ``--no_python``.
    """
    args = list(args)
    env = dict(os.environ if env is None else env)
    config = config_file_of(args)
    if config is not None:
        for name, value in odc_env_from_config(config).items():
            env.setdefault(name, value)
    launch_args, script, script_args, module, no_python = split_launch_args(args)
    odc = _odc_requested(env, script_args) if bootstrap is None else bootstrap
    if bootstrap is None and not odc and not no_python:
        # Plain FSDP2 as the config asks for it: on CPU accelerate alone would train one model per process.
        args = through_bootstrap(launch_args, script, script_args, module, odc=False)
    if odc:
        if no_python:
            raise ValueError(
                "This run asks for ODC, which needs a Python training script: drop --no_python, or switch ODC off "
                "(odc: false in the config file, or ODC_ENABLE=false)."
            )
        args = through_bootstrap(launch_args, script, script_args, module)
        # The 'cuda' transport keeps multicast off for its segment; set here, no worker writes its environment while
        # NCCL or gloo threads may read it. A value the user set wins.
        from .._compat.torch.symm_mem import MULTICAST_OFF_ENV

        env.setdefault(MULTICAST_OFF_ENV, "1")
    return subprocess.call([sys.executable, "-m", "accelerate.commands.launch", *args], env=env)


def main(argv: Sequence[str]) -> int:
    """``odc-accelerate launch ARGS``."""
    argv = list(argv)
    if accelerate_missing():
        print(f"odc-accelerate: {ACCELERATE_MISSING}", file=sys.stderr)
        return 2
    from .._compat import CompatError
    from .._compat.accelerate import check_launch, launch_parser

    try:
        check_launch()  # the accelerate internals read below, checked before any argument is
    except CompatError as err:
        print(f"odc-accelerate: {err}", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print(HELP + "\n")
        launch_parser().print_help()
        return 0
    try:
        return launch(argv)
    except ValueError as err:
        print(f"odc-accelerate: {err}", file=sys.stderr)
        return 2
