"""The `datasets` internals odc_accelerate reads, in one place.

:func:`arrow_column` reads a column as one pyarrow array through ``Dataset.data`` and ``Dataset._indices`` (a speed-up
only: `None` when the internals differ, and the caller reads the public API); :func:`fingerprint` is
``Dataset._fingerprint``, the same on every rank for the same data, and :func:`check` verifies it at start-up.
"""

from __future__ import annotations

import logging
from typing import Any

from . import CompatError, missing_message

logger = logging.getLogger(__name__)

__all__ = ["arrow_column", "check", "fingerprint"]

_LIBRARY = "datasets"


def arrow_column(dataset: Any, column: str) -> Any:
    """``dataset[column]`` as a pyarrow array in row order, or `None` if the dataset's internals differ."""
    table = getattr(dataset, "data", None)
    if table is None or not hasattr(table, "column") or not hasattr(dataset, "_indices"):
        return None
    try:
        arr = table.column(column)
        indices = dataset._indices
        if indices is not None:
            arr = arr.take(indices.column(0))
        return arr
    except Exception:  # noqa: BLE001 - internals changed: the caller uses the public path
        logger.debug("Falling back to row-by-row lengths for column %r", column, exc_info=True)
        return None


def fingerprint(dataset: Any) -> str | None:
    """``dataset``'s fingerprint (``Dataset._fingerprint``), or `None` for an object without one (an iterable or
    non-`datasets` dataset)."""
    value = getattr(dataset, "_fingerprint", None)
    return value if isinstance(value, str) and value else None


def check() -> None:
    """Raise `~odc_accelerate._compat.CompatError` if a `datasets.Dataset` no longer has a fingerprint."""
    from datasets import Dataset

    if fingerprint(Dataset.from_dict({"x": [0]})) is None:
        raise CompatError(missing_message("datasets.Dataset._fingerprint", library=_LIBRARY))
