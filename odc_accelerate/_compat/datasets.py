"""The one `datasets` internal odc_accelerate reads: a column of a `datasets.Dataset` as one pyarrow array.

`Dataset.data` is the backing table and `Dataset._indices` (None, or a one-column table) maps rows to it after
``.select`` / ``.shuffle`` / ``.train_test_split``. Reading them gives a dataset's lengths without a Python object per
row. This is a speed-up only: when the internals are not what is expected, :func:`arrow_column` returns `None` and the
caller reads the column through the public API (slower, same values), so no version check is needed here.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


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
