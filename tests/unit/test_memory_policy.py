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
    with pytest.raises(ValueError, match="reduction must be one of auto, atomic, ordered"):
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


def test_whether_a_policy_may_keep_gradients_is_decided_from_the_policy_as_configured():
    from types import SimpleNamespace

    groups = [SimpleNamespace(fqn=f, reduce_dtype=torch.float32) for f in ("<root>", "layers.0", "layers.1")]
    frozen_group = [SimpleNamespace(fqn="<root>", reduce_dtype=None)]

    def may(policy, gs=groups, **kw):
        return memory.may_keep_grads(memory_spec.parse_policy(policy), gs, **{"frozen": False, "ordered": False, **kw})

    assert may("auto") and may("grads") and may("both") and may("layers.1=grads")
    assert not may("neither") and not may("params") and not may("experts.*=grads")  # no group matches
    assert not may("auto", ordered=True) and not may("both", frozen=True) and not may("grads", frozen_group)


class _Accelerator:  # weak-referenceable, as accelerate's
    def __init__(self, plugin, sync_each_batch):
        from types import SimpleNamespace

        self.state = SimpleNamespace(fsdp_plugin=plugin)
        self.gradient_state = SimpleNamespace(plugin_kwargs={"sync_each_batch": sync_each_batch})
        self.is_main_process = False


@pytest.mark.parametrize("policy", ["auto", "grads", "layers.*=both"])
def test_sync_each_batch_is_refused_when_the_engine_attaches_whatever_this_rank_would_keep(monkeypatch, policy):
    """The refusal reads the policy as configured, when the engine attaches (before any step, the same on every rank):
    here this rank's own choice keeps nothing (``auto`` with little free memory), and it is refused all the same."""
    from types import SimpleNamespace

    import odc_accelerate.engine
    from odc_accelerate.integrations import accelerate as integration

    closed = []

    class Engine:  # the engine attached to the model: what the refusal reads
        def __init__(self, model, memory_policy, **kwargs):
            self.param_groups = ["<root>", "layers.0"]
            groups = [SimpleNamespace(fqn=f, reduce_dtype=torch.float32) for f in self.param_groups]
            self._policy = memory_spec.parse_policy(memory_policy)
            self.may_keep_grads = lambda: memory.may_keep_grads(self._policy, groups, frozen=False, ordered=False)
            self.memory_choices = lambda: dict.fromkeys(self.param_groups, "neither")
            self.close = lambda: closed.append(self)

    monkeypatch.setattr(odc_accelerate.engine, "ODCEngine", Engine)
    accelerator = _Accelerator(integration.ODCPlugin(memory_policy=policy), sync_each_batch=True)
    with pytest.raises(ValueError, match=f"sync_each_batch=True .* odc_memory_policy={policy} keeps unsharded"):
        integration._attach_engine(accelerator, object())
    assert len(closed) == 1 and integration.get_engine(accelerator) is None  # closed, not attached
    for ok_policy, sync in (("neither", True), ("params", True), (policy, False)):
        accelerator = _Accelerator(integration.ODCPlugin(memory_policy=ok_policy), sync_each_batch=sync)
        integration._attach_engine(accelerator, object())
        assert isinstance(integration.get_engine(accelerator), Engine)


def test_trainer_step_with_sync_each_batch_follows_the_set_up_decision_not_this_ranks_choice():
    """A rank whose ``auto`` kept gradients this step runs it: the refusal was decided at set-up, on every rank."""
    import contextlib
    from types import SimpleNamespace

    from odc_accelerate.integrations.trainer.step import ODCStepLoop

    class Trainer:  # what the loop's super().training_step reaches: one microbatch's loss
        loss_is_scaled_for_ga = True  # normalised by the step's loss items: the loop weights nothing
        model_accepts_loss_kwargs = True
        compute_loss_func = None

        def training_step(self, model, inputs, num_items_in_batch=None):
            return torch.ones(())

    class Loop(ODCStepLoop, Trainer):
        pass

    for choice in ("grads", "both", "neither", "params"):
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
            memory_choices=lambda choice=choice: {"<root>": choice, "layers.0": "neither"},
            pre_optimizer_step=lambda optimizer, steps=steps: steps.append(1),
        )
        loop.optimizer = None  # a Trainer has the attribute from __init__ on
        loop.odc_config = SimpleNamespace(memory_policy="auto", balanced=False)
        loop.odc_step_timer = SimpleNamespace(compute=lambda device: contextlib.nullcontext())
        loop.args = SimpleNamespace(device="cpu")
        assert float(loop.training_step(None, [{}, {}])) == 2.0 and steps == [1]
        assert loop.accelerator.gather == "real"
