"""torch's dispatcher modes: the base class of the tests' communication counter."""

from __future__ import annotations

from . import _import


def torch_dispatch_mode() -> type:
    """torch's ``TorchDispatchMode`` (private ``torch.utils._python_dispatch``): the base class of a mode that sees
    every op the dispatcher runs, as the test helpers' communication counter does."""
    return _import("torch.utils._python_dispatch", "TorchDispatchMode")
