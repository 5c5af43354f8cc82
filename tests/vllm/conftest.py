"""The vLLM tests run where vLLM is installed (`bash scripts/vllm_env.sh tests/vllm` builds such an environment: vLLM
pins torch and transformers more tightly than odc_accelerate does). Elsewhere every test in this folder is skipped, with
the reason."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from pathlib import Path

import pytest

_FOLDER = Path(__file__).parent


@functools.cache
def _missing_vllm() -> str | None:
    """Why vLLM cannot be used here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return (
            "vLLM is not installed: `bash scripts/vllm_env.sh tests/vllm` runs these tests in an environment with it"
        )
    try:
        importlib.import_module("vllm")
    except Exception as err:  # noqa: BLE001 - any import failure means these tests cannot run here
        return f"vLLM is installed but does not import ({type(err).__name__}: {err}); see docs/vllm.md"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if _FOLDER in Path(item.fspath).parents]
    if not mine:
        return
    reason = _missing_vllm()
    if reason is not None:
        for item in mine:
            item.add_marker(pytest.mark.skip(reason=reason))
