"""Generic validators shared by the configuration and the planners (a leaf module: it imports nothing of the
package, so that `odc_accelerate.config` and `odc_accelerate.planning` can both use it without importing each other)."""

from typing import Any

__all__ = ["check_positive_int", "str_to_bool"]

_TRUE = ("1", "true", "yes", "on", "y", "t")
_FALSE = ("0", "false", "no", "off", "n", "f")


def str_to_bool(value: Any, name: str = "value") -> bool:
    """Parse a boolean option given as a `bool` or a string such as ``"true"``, ``"0"`` or ``"off"``.

    Raises:
        ValueError: ``value`` is neither, naming ``name``.
    """
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{name} must be a boolean (true/false), got {value!r}.")


def check_positive_int(value: Any, name: str) -> int:
    """``value`` as an `int` if it is a positive integer (an integer-valued string counts), else a `ValueError`
    naming ``name``."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return int(value)
