"""Markers by folder: everything under ``tests/multiprocess`` is marked ``multiprocess`` (see tests/README.md)."""

from pathlib import Path

import pytest

_MULTIPROCESS = Path(__file__).parent / "multiprocess"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _MULTIPROCESS in Path(item.fspath).parents:
            item.add_marker(pytest.mark.multiprocess)
