"""accelerate's own step calls driving the ODC engine (`odc_accelerate.integrations.accelerate.drive_steps`), in one
process: accelerate's real ``Accelerator.clip_grad_norm_`` and ``AcceleratedOptimizer.step``, wrapped by
`odc_accelerate.enable`, around an engine that records its calls. The 2-rank runs are in
``tests/multiprocess/test_integration_accelerate_loop.py``."""

from __future__ import annotations

import pytest
import torch

from odc_accelerate.engine.stats import EngineState


class _Engine:
    """What the driving reads of an `ODCEngine`: its state, and its two step calls."""

    def __init__(self) -> None:
        self.state = EngineState.IN_STEP
        self.calls: list[str] = []
        self.transport = object()

    def pre_optimizer_step(self, optimizer=None) -> None:
        assert self.state is EngineState.IN_STEP, "pre_optimizer_step() called twice"
        self.calls.append("pre")
        self.state = EngineState.IN_OPTIMIZER

    def post_optimizer_step(self) -> None:
        assert self.state is EngineState.IN_OPTIMIZER
        self.calls.append("post")
        self.state = EngineState.IN_STEP


@pytest.fixture
def loop():
    """An accelerator (one process, gradient accumulation 2) with one prepared optimizer and a recording engine
    attached to it."""
    from accelerate import Accelerator

    from odc_accelerate.integrations import accelerate as integration

    integration.enable()
    accelerator = Accelerator()  # as other tests of this process build it (accelerate's state is shared)
    accelerator.gradient_accumulation_steps = 2
    model = torch.nn.Linear(2, 1)
    optimizer = accelerator.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    engine = _Engine()
    integration._ENGINES[accelerator] = engine
    yield accelerator, model, optimizer, engine
    integration._ENGINES.pop(accelerator, None)
    accelerator.gradient_accumulation_steps = 1


def _microbatch(accelerator, model, optimizer, clip: bool = True) -> None:
    with accelerator.accumulate(model):
        accelerator.backward(model(torch.ones(1, 2)).sum())
        if clip and accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()


def test_the_step_boundary_folds_before_clipping_and_publishes_after_the_step(loop):
    accelerator, model, optimizer, engine = loop
    _microbatch(accelerator, model, optimizer)  # no sync: optimizer.step() is a no-op, the engine is left alone
    assert engine.calls == []
    _microbatch(accelerator, model, optimizer)
    assert engine.calls == ["pre", "post"]
    # without clipping, optimizer.step() makes both calls
    _microbatch(accelerator, model, optimizer, clip=False)
    _microbatch(accelerator, model, optimizer, clip=False)
    assert engine.calls == ["pre", "post"] * 2


def test_a_loop_that_calls_the_engine_itself_keeps_its_calls(loop):
    accelerator, model, optimizer, engine = loop
    accelerator.gradient_accumulation_steps = 1
    accelerator.backward(model(torch.ones(1, 2)).sum())
    engine.pre_optimizer_step(optimizer)  # the get_engine loop
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    engine.post_optimizer_step()
    assert engine.calls == ["pre", "post"]


def test_the_odc_trainers_switch_the_driving_off(loop):
    from odc_accelerate.integrations.accelerate import drive_steps

    accelerator, model, optimizer, engine = loop
    drive_steps(accelerator, False)
    for _ in range(2):
        _microbatch(accelerator, model, optimizer)
    assert engine.calls == []
    drive_steps(accelerator, True)
    for _ in range(2):
        _microbatch(accelerator, model, optimizer)
    assert engine.calls == ["pre", "post"]


def test_several_optimizers_are_refused_before_any_step_call(loop):
    accelerator, model, optimizer, engine = loop
    second = accelerator.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.gradient_accumulation_steps = 1
    accelerator.backward(model(torch.ones(1, 2)).sum())
    with pytest.raises(ValueError, match=r"one optimizer, but this Accelerator prepared 2 \(optimizer.step\(\)"):
        second.step()
    with pytest.raises(
        ValueError, match=r"prepared 2 \(accelerator.clip_grad_norm_ / clip_grad_value_ was called\).*get_engine"
    ):
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
    assert engine.calls == [] and engine.state is EngineState.IN_STEP
