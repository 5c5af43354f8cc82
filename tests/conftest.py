"""Markers by folder: everything under ``tests/multiprocess`` is marked ``multiprocess``, everything under
``tests/install`` ``install`` (see tests/README.md)."""

from pathlib import Path

import pytest

_MARKER_OF_FOLDER = {
    Path(__file__).parent / "multiprocess": pytest.mark.multiprocess,
    Path(__file__).parent / "install": pytest.mark.install,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parents = Path(item.fspath).parents
        for folder, marker in _MARKER_OF_FOLDER.items():
            if folder in parents:
                item.add_marker(marker)
