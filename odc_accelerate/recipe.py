"""The ODC options of a TRL script's arguments: a ``--config recipe.yaml`` file's keys and command-line flags.

TRL's scripts parse with ``fail_with_unknown_args=False``: a recipe key that no argument dataclass knows is dropped
silently (`trl.TrlParser` keeps such keys for ``accelerate launch``), so a misspelt ``odc_plam: free`` would train with
the default plan. Every ``odc*`` name is checked here against the ODC training-argument fields instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .config import training_args_fields
from .validation import str_to_bool

__all__ = ["check_odc_flags", "check_recipe_keys", "odc_flag_value", "read_recipe", "recipe_path"]


def _known() -> list[str]:
    return [name for name, _, _ in training_args_fields()]


def check_recipe_keys(recipe: Mapping[str, Any], where: str = "the --config recipe") -> None:
    """Raise a `ValueError` listing the known keys if ``recipe`` has an ``odc*`` key that is not an ODC option."""
    known = _known()
    unknown = [key for key in recipe if str(key).startswith("odc") and key not in known]
    if unknown:
        raise ValueError(
            f"Unknown ODC key(s) {', '.join(map(repr, unknown))} in {where}; known keys: {', '.join(known)}."
        )


def check_odc_flags(args: Iterable[str], where: str = "the command line") -> None:
    """Raise a `ValueError` listing the known flags if ``args`` holds an ``--odc*`` flag that is not an ODC option."""
    known = _known()
    unknown = []
    for arg in args:
        if arg.startswith("--odc"):
            name = arg[2:].split("=", 1)[0]
            if name not in known:
                unknown.append(f"--{name}")
    if unknown:
        raise ValueError(
            f"Unknown ODC argument(s) {', '.join(unknown)} on {where}; known: "
            f"{', '.join('--' + name for name in known)}."
        )


def recipe_path(script_args: Sequence[str]) -> str | None:
    """The file that follows ``--config`` in a TRL script's arguments (`trl.TrlParser` takes only that spelling)."""
    args = list(script_args)
    if "--config" in args:
        at = args.index("--config")
        if at + 1 < len(args):
            return args[at + 1]
    return None


def read_recipe(path: str | os.PathLike) -> dict[str, Any] | None:
    """The mapping a YAML recipe holds, with its ``odc*`` keys checked; None if ``path`` is not a YAML mapping (some
    scripts take ``--config`` for another kind of file: it is theirs to read)."""
    import yaml

    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            recipe = yaml.safe_load(f)
    except yaml.YAMLError:
        return None
    if not isinstance(recipe, dict):
        return None
    check_recipe_keys(recipe, where=f"the recipe {os.fspath(path)}")
    return recipe


def odc_flag_value(script_args: Sequence[str]) -> bool | None:
    """The value of the last ``--odc`` flag in a script's arguments (``--odc`` alone, ``--odc true``, ``--odc=false``);
    None if there is none."""
    args = list(script_args)
    value: bool | None = None
    for i, arg in enumerate(args):
        if arg == "--odc":
            following = args[i + 1] if i + 1 < len(args) else None
            value = True if following is None or following.startswith("--") else str_to_bool(following, "--odc")
        elif arg.startswith("--odc="):
            value = str_to_bool(arg.split("=", 1)[1], "--odc")
    return value
