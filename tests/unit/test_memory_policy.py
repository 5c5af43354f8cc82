"""The step memory policy's parsing and its ``auto`` choice (no processes needed)."""

import pytest
import torch

from odc_accelerate import memory_spec
from odc_accelerate.engine import ODCEngine, memory


def test_parse_policy_accepts_choices_auto_and_patterns():
    assert memory_spec.parse_policy("both") == [("*", "both")]
    assert memory_spec.parse_policy(" Neither ") == [("*", "neither")]
    assert memory_spec.parse_policy("auto") == "auto"
    assert memory_spec.parse_policy("<root>=params, layers.*=both") == [("<root>", "params"), ("layers.*", "both")]
    assert memory_spec.parse_policy({"layers.0": "grads"}) == [("layers.0", "grads")]


@pytest.mark.parametrize("bad", ["all", "layers.*=everything", "=both", "", 3])
def test_parse_policy_refuses_bad_values_naming_the_choices(bad):
    with pytest.raises(ValueError, match="neither"):
        memory_spec.parse_policy(bad)


def test_fixed_policy_first_match_wins_and_unmatched_groups_keep_nothing():
    pairs = memory_spec.parse_policy("layers.0=both,layers.*=grads")
    got = memory.choose_fixed(pairs, ["<root>", "layers.0", "layers.1"])
    assert got == {"<root>": (False, False), "layers.0": (True, True), "layers.1": (False, True)}


def test_parse_headroom():
    assert memory_spec.parse_headroom("30%") == (0.3, True)
    assert memory_spec.parse_headroom("4GiB") == (4 * 2**30, False)
    assert memory_spec.parse_headroom("512 MB") == (512e6, False)
    assert memory_spec.parse_headroom(1024) == (1024.0, False)
    for bad in ("lots", "150%", -1, True):
        with pytest.raises(ValueError, match="headroom"):
            memory_spec.parse_headroom(bad)


def test_auto_keeps_largest_gain_per_byte_first_within_budget():
    mb = 2**20
    costs = [
        memory.GroupCost("<root>", param_bytes=40 * mb, grad_bytes=40 * mb, gathers_per_microbatch=1, world_size=2),
        memory.GroupCost("b0", param_bytes=10 * mb, grad_bytes=10 * mb, gathers_per_microbatch=2, world_size=2),
        memory.GroupCost("b1", param_bytes=10 * mb, grad_bytes=10 * mb, gathers_per_microbatch=2, world_size=2),
    ]
    # gain per byte: block params 4 > grads 3 > root params 2 (gathered once per microbatch)
    assert memory.choose_auto(costs, 0) == dict.fromkeys(("<root>", "b0", "b1"), (False, False))
    assert memory.choose_auto(costs, 20 * mb) == {"<root>": (False, False), "b0": (True, False), "b1": (True, False)}
    assert memory.choose_auto(costs, 80 * mb) == {"<root>": (False, True), "b0": (True, True), "b1": (True, True)}
    assert memory.choose_auto(costs, 160 * mb) == dict.fromkeys(("<root>", "b0", "b1"), (True, True))
    assert memory.summarize(memory.choose_auto(costs, 20 * mb)) == "neither x1, params x2"


def test_ordered_reduction_keeps_no_unsharded_gradient():
    # Under ordered the contribution buffers hold the step's gradient already: the gradient half of every fixed
    # choice is dropped (grads acts as neither, both as params), whatever the pattern.
    fqns = ["<root>", "blocks.0", "blocks.1"]
    policy = memory_spec.parse_policy("<root>=grads,blocks.0=both,*=params")
    fixed = memory.choose_fixed(policy, fqns)
    assert fixed == {"<root>": (False, True), "blocks.0": (True, True), "blocks.1": (True, False)}

    class Group:  # what choose reads of a served group for a fixed policy
        def __init__(self, fqn):
            self.fqn = fqn

    groups = [Group(f) for f in fqns]
    ordered = memory.choose(policy, (0.3, True), torch.device("cpu"), groups, world_size=2, frozen=False, ordered=True)
    assert ordered == {"<root>": (False, False), "blocks.0": (True, False), "blocks.1": (True, False)}


def test_engine_refuses_a_bad_reduction_before_anything_else():
    with pytest.raises(ValueError, match="reduction must be one of atomic, ordered"):
        ODCEngine(torch.nn.Linear(2, 2), reduction="summed")


def test_free_memory_on_cpu_is_shared_by_the_hosts_ranks(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    free1, total1 = memory_spec.free_and_total(torch.device("cpu"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    free4, total4 = memory_spec.free_and_total(torch.device("cpu"))
    assert 0 < free1 <= total1 and total4 == total1 // 4
    assert free4 <= free1 // 4 + 2**30  # MemAvailable moves a little between the reads


def test_engine_refuses_a_bad_policy_before_anything_else():
    with pytest.raises(ValueError, match="memory policy 'sometimes'"):
        ODCEngine(torch.nn.Linear(2, 2), memory_policy="sometimes")
    with pytest.raises(ValueError, match="headroom"):
        ODCEngine(torch.nn.Linear(2, 2), memory_headroom="a bit")


def test_trainer_refuses_sync_each_batch_with_a_policy_that_keeps_gradients():
    import contextlib
    from types import SimpleNamespace

    from odc_accelerate.integrations.trainer.step import ODCStepLoop

    class Trainer:  # what the loop's super().training_step reaches: one microbatch's loss
        def training_step(self, model, inputs, num_items_in_batch=None):
            return torch.ones(())

    class Loop(ODCStepLoop, Trainer):
        pass

    def loop_with(choice: str) -> Loop:
        loop = Loop()
        loop.accelerator = SimpleNamespace(
            gradient_state=SimpleNamespace(plugin_kwargs={"sync_each_batch": True}),
            gather_for_metrics="real",
            gather="real",
            reduce="real",
            num_processes=1,
        )
        steps = []
        loop.odc_engine = SimpleNamespace(
            memory_choices=lambda: {"<root>": choice, "layers.0": "neither"},
            pre_optimizer_step=lambda optimizer: steps.append(1),
        )
        loop.optimizer = None  # a Trainer has the attribute from __init__ on
        loop.odc_config = SimpleNamespace(memory_policy=choice)
        loop.odc_step_timer = SimpleNamespace(compute=lambda device: contextlib.nullcontext())
        loop.args = SimpleNamespace(device="cpu")
        loop.steps = steps
        return loop

    for choice in ("grads", "both"):
        loop = loop_with(choice)
        with pytest.raises(ValueError, match=f"sync_each_batch=True .* odc_memory_policy={choice} keeps"):
            loop.training_step(None, [{}, {}])
        assert (loop.accelerator.gather, loop.steps) == ("real", [])  # refused before anything changed
    for choice in ("neither", "params"):  # they reduce every microbatch, as sync_each_batch asks
        loop = loop_with(choice)
        assert float(loop.training_step(None, [{}, {}])) == 2.0 and loop.steps == [1]
        assert loop.accelerator.gather == "real"
