"""The stored benchmark results the simulator is calibrated on and validated against.

Every figure comes from a results file a benchmark wrote; a missing file is an error that names the command writing
it. Defaults are the stored results next to each benchmark's code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.e2e import RESULTS_DIR as E2E_DIR
from benchmarks.engine import RESULTS_DIR as ENGINE_DIR
from benchmarks.transport import RESULTS_DIR as TRANSPORT_DIR

ENGINE_RESULTS = ENGINE_DIR / "results.json"
TRANSPORT_RESULTS = TRANSPORT_DIR / "results.json"
E2E_SFT_RESULTS = E2E_DIR / "sft_grads" / "results.json"


def _read(path: str | Path, command: str) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: run `{command}`, which writes its stored results (`{command} --out DIR` writes "
            "DIR/results.json)."
        )
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        # a saved console output of the benchmark: its last JSON line is the summary
        lines = [line for line in text.splitlines() if line.startswith("{")]
        if not lines:
            raise ValueError(f"{path} holds no JSON: pass the results.json that `{command}` writes.") from None
        return json.loads(lines[-1])


def load_engine_result(path: str | Path = ENGINE_RESULTS) -> dict[str, Any]:
    """The engine benchmark's summary (``python -m benchmarks.engine``): per-arm median step times and its config."""
    return _read(path, "python -m benchmarks.engine")


def load_shm_figures(path: str | Path = TRANSPORT_RESULTS) -> dict[str, float]:
    """Shared-memory transport figures from the transport benchmark (``python -m benchmarks.transport``).

    Returns ``{"read_MBps", "acc_MBps", "read_us", "acc_us", "barrier_us"}``: 1 MiB read / accumulate bandwidth (the
    engine's per-peer transfers are 1-2 MB, nearest that column), 64 B read / accumulate latency and one barrier.
    """
    shm = _read(path, "python -m benchmarks.transport")["results"]["shm"]
    return {
        "read_MBps": shm["read_1MiB_MBps"],
        "acc_MBps": shm["acc_1MiB_MBps"],
        "read_us": shm["read_latency_us"],
        "acc_us": shm["acc_latency_us"],
        "barrier_us": shm["barrier_latency_us"],
    }


def load_e2e_result(path: str | Path = E2E_SFT_RESULTS) -> dict[str, Any]:
    """An end-to-end benchmark result with its step traces (``python -m benchmarks.e2e sft``)."""
    return _read(path, "python -m benchmarks.e2e sft")
