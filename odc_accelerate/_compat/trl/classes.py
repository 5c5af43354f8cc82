"""The public names of TRL's trainer classes, which ``odc_accelerate.cli.bootstrap`` makes return the ODC trainers
(TRL's own ``trl/scripts/sft.py`` then trains with ODC, unmodified).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from .. import require
from . import _LIBRARY

#: The classes `replace_public_classes` may replace, and the modules a script imports them from: ``from trl import
#: SFTTrainer`` and ``from trl.trainer import SFTTrainer``. The modules that define them (``trl.trainer.sft_trainer``,
#: ...) keep TRL's classes, so TRL's own code and the TRL trainers defined on top of them (GKD, GOLD, ...) are
#: unchanged.
PUBLIC_CLASSES = (
    "SFTConfig",
    "SFTTrainer",
    "DPOConfig",
    "DPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "RewardConfig",
    "RewardTrainer",
    "RLOOConfig",
    "RLOOTrainer",
    "KTOConfig",
    "KTOTrainer",
)
PUBLIC_MODULES = ("trl", "trl.trainer")
_REPLACED: dict[tuple[str, str], Any] = {}


def replace_public_classes(replacements: dict[str, type]) -> None:
    """Make the names of `PUBLIC_CLASSES` in `PUBLIC_MODULES` return the given subclasses (`restore_public_classes`
    undoes it).

    Args:
        replacements (`dict[str, type]`): TRL class name -> its replacement, a subclass of TRL's class.

    Raises:
        ValueError: a name outside `PUBLIC_CLASSES`.
        TypeError: a replacement that does not subclass the TRL class it replaces.
    """
    unknown = set(replacements) - set(PUBLIC_CLASSES)
    if unknown:
        raise ValueError(f"Only {', '.join(PUBLIC_CLASSES)} can be replaced, not {', '.join(sorted(unknown))}.")
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name, cls in replacements.items():
            original = _REPLACED.get((module_name, name))
            if original is None:
                original = require(module, name, library=_LIBRARY, where=module_name)
            if not (isinstance(cls, type) and issubclass(cls, original)):
                raise TypeError(f"{module_name}.{name} can only be replaced by a subclass of it, not {cls!r}.")
            _REPLACED.setdefault((module_name, name), original)
            setattr(module, name, cls)


def restore_public_classes() -> None:
    """Give back TRL's classes replaced by `replace_public_classes`."""
    for (module_name, name), original in _REPLACED.items():
        setattr(sys.modules[module_name], name, original)
    _REPLACED.clear()
