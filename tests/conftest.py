"""Markers by folder: everything under ``tests/multiprocess`` is marked ``multiprocess``, everything under
``tests/install`` ``install`` (see tests/README.md). The install tests run last, and the environment they need starts
building in the background as soon as they are collected (mostly pip: downloads and unpacking; several minutes that
the other tests run through)."""

import os
from pathlib import Path

import pytest

# The offline model's LM head is Qwen's 152k-token vocabulary, most of a CPU step's compute; the suite keeps the first
# 8,192 BPE ranks (a valid smaller BPE: `odc_accelerate.demo.offline_bpe_ranks`), which makes a step ~10x faster. Jobs
# the tests start inherit it. The install tests run the README's main job at the true default; ODC_OFFLINE_BPE_RANKS=151643
# runs all at full size.
os.environ.setdefault("ODC_OFFLINE_BPE_RANKS", "8192")

# What the tests run (helpers/) and the GPU procedure (gpu/, run by scripts/gpu_session.sh) hold no test modules: their
# names do not match pytest's `test_*.py` either, and this keeps `pytest tests/gpu` from collecting one that did.
collect_ignore = ["helpers", "gpu"]

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
    # Stable: the other tests keep their order.
    items.sort(key=lambda item: item.get_closest_marker("install") is not None)


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    if any(item.get_closest_marker("install") for item in session.items):
        from tests.helpers.infra import install_env

        install_env.start()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from tests.helpers.infra import warm_start

    if warm_start.entries:
        forked = sum(entry.startswith("forked") for entry in warm_start.entries)
        terminalreporter.write_sep("-", f"warm start: {forked} of {len(warm_start.entries)} Python processes forked")
        for entry in warm_start.entries:
            if not entry.startswith("forked"):
                terminalreporter.write_line(entry)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tests.helpers.infra import install_env

    install_env.stop()  # an interrupted or failed session leaves no pip running and no environment behind


def _trl_version() -> tuple[int, int]:
    import importlib.metadata

    from odc_accelerate._compat import version_tuple

    return version_tuple(importlib.metadata.version("trl"))


#: GRPO and RLOO under ODC need TRL 1.16 (older TRL is refused at set-up, which `scripts/compat.sh ... --hf-previous`
#: runs on): tests that build one of their trainers skip there, saying so.
requires_trl_116 = pytest.mark.skipif(
    _trl_version() < (1, 16), reason="GRPO and RLOO under ODC need TRL 1.16 (refused on older TRL)"
)
#: The hybrid linear-attention and vision-language paths are tested with TRL 1.16 and transformers 5.24 only (TRL 1.15
#: neither emits the packed boundaries nor takes a Qwen3-VL for a vision-language model): their tests skip below.
requires_hf_current = pytest.mark.skipif(
    _trl_version() < (1, 16), reason="hybrid and vision-language models are tested with TRL 1.16 / transformers 5.24"
)
