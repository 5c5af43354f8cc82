"""The `datasets` internals odc_accelerate reads, in one place.

* A column of a `datasets.Dataset` as one pyarrow array (:func:`arrow_column`): `Dataset.data` is the backing table and
  `Dataset._indices` (None, or a one-column table) maps rows to it after ``.select`` / ``.shuffle`` /
  ``.train_test_split``. Reading them gives a dataset's lengths without a Python object per row. A speed-up only: when
  the internals are not what is expected it returns `None` and the caller reads the column through the public API
  (slower, same values).
* A dataset's fingerprint (:func:`fingerprint`), ``Dataset._fingerprint``: the hash of its content and transforms that
  `datasets` keys its own cache on; the same on every rank for the same data. :func:`check` verifies at start-up that
  a dataset has one.
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
