"""The ODC options of a run are resolved once and never written to afterwards: a resolved `ODCConfig` (and the ODC
fields of an `ODCPlugin`) refuse assignment, one trainer resolves its options once and hands that object on (the
plugin it builds, GRPO's and SFT's checks), and what the trainer derives at run time is on its ``odc_run``."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from odc_accelerate.config import ODCConfig
from odc_accelerate.integrations.trainer.run import ODCRun
from tests.conftest import requires_trl_116


@pytest.fixture
def resolutions(monkeypatch):
    """Every `ODCConfig.from_sources` call from now on, by its keyword arguments."""
    calls: list[dict] = []
    original = ODCConfig.from_sources.__func__

    def counting(cls, **kwargs):
        calls.append(kwargs)
        return original(cls, **kwargs)

    monkeypatch.setattr(ODCConfig, "from_sources", classmethod(counting))
    return calls


def test_a_resolved_config_refuses_assignment_and_replace_makes_a_checked_copy():
    config = ODCConfig.from_sources(env={"ODC_ENABLE": "true", "ODC_PLAN": "lockstep"})
    for name, value in (("samples_per_step", 8), ("max_tokens_per_microbatch", 64), ("plan", "free"), ("source", "x")):
        with pytest.raises(dataclasses.FrozenInstanceError, match=rf"read-only: cannot set '{name}'.*replace"):
            setattr(config, name, value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.anything_new = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        del config.trace_dir
    assert (config.plan, config.samples_per_step, config.max_tokens_per_microbatch) == ("lockstep", None, None)
    changed = dataclasses.replace(config, samples_per_step="16")
    assert changed.samples_per_step == 16 and config.samples_per_step is None  # coerced by construction
    assert (changed.source, changed.given) == (config.source, config.given)
    with pytest.raises(ValueError, match="odc_samples_per_step"):
        dataclasses.replace(config, samples_per_step=0)  # validated like any construction


def test_the_plugin_holds_one_resolved_config_and_its_odc_fields_are_read_only(resolutions):
    from odc_accelerate.integrations.accelerate import ODCPlugin

    plugin = ODCPlugin(transport="shm")  # resolves its own options, once
    assert len(resolutions) == 1 and plugin.odc_config.transport == plugin.transport == "shm"
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot set 'transport'"):
        plugin.transport = "network"
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot set 'odc_config'"):
        plugin.odc_config = ODCConfig()
    plugin.cpu_offload = plugin.cpu_offload  # accelerate's own FSDP fields stay writable

    resolved = ODCConfig(enable=True, plan="lockstep", memory_policy="grads", source="env", given={"plan": "env"})
    held = ODCPlugin(odc_config=resolved)  # options resolved elsewhere (the ODC Trainer's): taken as they are
    assert len(resolutions) == 1 and held.odc_config is resolved
    assert (held.plan, held.memory_policy, held.source, held.given) == ("lockstep", "grads", "env", {"plan": "env"})
    with pytest.raises(TypeError, match="odc_config and ODC option"):
        ODCPlugin(odc_config=resolved, transport="shm")


def test_the_trainers_plugin_is_built_from_the_trainers_config(monkeypatch, resolutions):
    from odc_accelerate.integrations.trainer.setup import ODCAcceleratorSetup

    class Trainer:  # what `transformers.Trainer` adds after the mixin
        def _build_accelerator_args(self, **kwargs):
            return kwargs

    class ODCTrainer(ODCAcceleratorSetup, Trainer):
        pass

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    trainer = ODCTrainer()
    trainer.odc_config = ODCConfig(enable=True, transport="shm")
    trainer.args = SimpleNamespace(fsdp_plugin_args={"fsdp_version": 2})
    plugin = ODCAcceleratorSetup._build_accelerator_args(trainer)["fsdp_plugin"]
    assert plugin.odc_config is trainer.odc_config and resolutions == []


def test_a_plain_accelerator_built_by_a_trainer_takes_the_trainers_options(monkeypatch):
    """Under ``ODC_ENABLE=true`` a plain ``Accelerator()`` asks for an ODC plugin; a trainer whose own options turned
    ODC off (an explicit ``--odc false``) decides instead, with no second resolution."""
    from odc_accelerate.integrations.accelerate import odc_plugin_from_env, resolved_options

    monkeypatch.setenv("ODC_ENABLE", "true")
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    with pytest.raises(ValueError, match="ODC_ENABLE=true but the launch is not FSDP"):
        odc_plugin_from_env()
    off = ODCConfig.from_sources(args=SimpleNamespace(odc=False))
    with resolved_options(off):
        assert odc_plugin_from_env() is None


def _sft_trainer(tmp_path, padding_free=True, **odc):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from odc_accelerate import ODCSFTConfig, ODCSFTTrainer
    from odc_accelerate.demo import load_offline_tokenizer
    from odc_accelerate.testing.models import tiny_causal_lm_config

    args = ODCSFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
        max_length=24,
        padding_free=padding_free,  # under a plan SFT needs the options before TRL's set-up: resolved there, once
        report_to="none",
        bf16=False,
        **odc,
    )
    return ODCSFTTrainer(
        model=AutoModelForCausalLM.from_config(tiny_causal_lm_config("tied", hidden_size=16)),
        args=args,
        train_dataset=Dataset.from_dict({"text": ["one two three four five six"] * 12}),
        processing_class=load_offline_tokenizer(),
    )


@pytest.mark.parametrize(
    ("odc", "samples"),
    [({"odc_plan": "lockstep"}, 2 * 3 * 1), ({"odc_plan": "free", "odc_samples_per_step": 4}, 4)],
)
def test_an_sft_trainer_resolves_once_and_derives_what_the_config_used_to_hold(tmp_path, resolutions, odc, samples):
    """One process, ODC off, a plan on: the whole set-up and the balanced loader run. The options are resolved once;
    the derived values are on ``odc_run``, equal to what the set-up and the loader used to write into the config."""
    trainer = _sft_trainer(tmp_path, odc=False, **odc)
    assert len(resolutions) == 1, resolutions
    config = trainer.odc_config
    assert trainer.odc_run == ODCRun(samples_per_step=samples, folded_accumulation=3)
    assert trainer.args.gradient_accumulation_steps == 1  # folded into each rank's step
    trainer.get_train_dataloader()
    # The budget's automatic choice: max_length (the samples are truncated to it).
    assert trainer.odc_run == ODCRun(samples_per_step=samples, folded_accumulation=3, max_tokens_per_microbatch=24)
    assert trainer._odc_sampler.samples_per_step == samples and trainer._odc_sampler.max_tokens_per_microbatch == 24
    assert trainer.odc_config is config and len(resolutions) == 1
    assert config.samples_per_step == odc.get("odc_samples_per_step") and config.max_tokens_per_microbatch is None


def test_without_a_plan_nothing_is_derived(tmp_path, resolutions):
    trainer = _sft_trainer(tmp_path, padding_free=False, odc=False)  # TRL alone refuses padding_free here
    assert len(resolutions) == 1 and trainer.odc_run == ODCRun()
    assert trainer.args.gradient_accumulation_steps == 3  # the Trainer's own accumulation


@requires_trl_116
def test_a_grpo_trainer_resolves_once_for_its_checks_and_its_set_up(tmp_path, resolutions, monkeypatch):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from odc_accelerate.demo import load_offline_tokenizer
    from odc_accelerate.integrations.trl import ODCGRPOConfig, ODCGRPOTrainer
    from odc_accelerate.integrations.trl import grpo as grpo_module
    from odc_accelerate.testing.models import tiny_causal_lm_config

    checked = []
    check = grpo_module.check_grpo_settings
    monkeypatch.setattr(grpo_module, "check_grpo_settings", lambda *a: checked.append(a[-1]) or check(*a))
    args = ODCGRPOConfig(
        output_dir=str(tmp_path),
        odc=False,
        odc_plan="lockstep",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        report_to="none",
        bf16=False,
    )
    trainer = ODCGRPOTrainer(
        model=AutoModelForCausalLM.from_config(tiny_causal_lm_config("tied", hidden_size=16)),
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["one two three"] * 8}),
        processing_class=load_offline_tokenizer(),
    )
    assert len(resolutions) == 1 and checked == [trainer.odc_config]
    assert trainer.odc_run == ODCRun(samples_per_step=4 * 2, folded_accumulation=2)  # budget: chosen per step


def test_free_plan_without_odc_on_several_ranks_is_refused_before_any_work():
    """Plain FSDP2 cannot pair collectives across ranks running different microbatch counts: the free plan without
    ODC is refused on several ranks, allowed on one rank (the no-communication limit) and with lockstep."""
    from odc_accelerate.integrations.trainer.setup import check_plan_without_odc

    free_off = ODCConfig.from_sources(args=SimpleNamespace(odc=False, odc_plan="free"))
    with pytest.raises(ValueError, match="odc_plan 'free' needs ODC.*--odc_plan lockstep"):
        check_plan_without_odc(free_off, world_size=2)
    check_plan_without_odc(free_off, world_size=1)
    check_plan_without_odc(ODCConfig.from_sources(args=SimpleNamespace(odc=False, odc_plan="lockstep")), world_size=2)
    check_plan_without_odc(ODCConfig.from_sources(args=SimpleNamespace(odc=True, odc_plan="free")), world_size=2)
