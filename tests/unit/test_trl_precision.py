"""The ODC TRL configs' precision defaults on machines without a bf16-capable GPU (capability checks replaced)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("trl")

from odc_accelerate.integrations.trl import configs as trl_configs  # noqa: E402


def _args(**kwargs):
    return SimpleNamespace(**{"bf16": None, "fp16": False, "use_cpu": False, **kwargs})


@pytest.fixture
def machine(monkeypatch):
    """Set what the machine offers: ``machine(bf16_gpu=..., gpu=...)``."""

    def set_machine(*, bf16_gpu: bool, gpu: bool) -> None:
        monkeypatch.setattr(trl_configs, "_gpu_bf16_available", lambda: bf16_gpu)
        monkeypatch.setattr(trl_configs, "_has_accelerator", lambda: gpu)

    return set_machine


def test_bf16_on_a_gpu_without_bf16_stops_instead_of_moving_to_cpu(machine):
    machine(bf16_gpu=False, gpu=True)
    args = _args(bf16=True)
    with pytest.raises(ValueError, match=r"GPU does not support bf16\. Pass --bf16 false .* --use_cpu true"):
        trl_configs.cpu_precision_defaults(args)
    assert args.use_cpu is False
    # asked for in so many words, the CPU is used
    args = _args(bf16=True, use_cpu=True)
    trl_configs.cpu_precision_defaults(args)
    assert (args.bf16, args.use_cpu) == (True, True)
    # the default precision on such a GPU is fp32, on the GPU
    args = _args()
    trl_configs.cpu_precision_defaults(args)
    assert (args.bf16, args.use_cpu) == (False, False)


def test_bf16_without_any_gpu_runs_on_cpu(machine):
    machine(bf16_gpu=False, gpu=False)
    args = _args(bf16=True)
    trl_configs.cpu_precision_defaults(args)
    assert (args.bf16, args.use_cpu) == (True, True)
    args = _args()
    trl_configs.cpu_precision_defaults(args)
    assert (args.bf16, args.use_cpu) == (False, False)


def test_a_bf16_gpu_keeps_trls_defaults(machine):
    machine(bf16_gpu=True, gpu=True)
    args = _args(bf16=True)
    trl_configs.cpu_precision_defaults(args)
    assert (args.bf16, args.use_cpu) == (True, False)
    args = _args()
    trl_configs.cpu_precision_defaults(args)
    assert args.bf16 is None
