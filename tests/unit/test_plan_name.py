"""`PlanName`: every plan name parses from every surface (constructor, training arguments, ``--odc_plan`` flag, recipe,
``fsdp_config`` keys and file, ``ODC_PLAN``, ``odc-accelerate config``) to the same member, and renders and compares as
the plain string it replaced."""

from __future__ import annotations

import json
import logging
import re
from types import SimpleNamespace

import pytest
import yaml

import odc_accelerate
from odc_accelerate.config import ODCConfig, env_from_fsdp_config, option_fields, training_args_fields
from odc_accelerate.planning import PLANS, PlanName, normalize_plan, plan_step

ENV_NAMES = [f.metadata["env"] for f in option_fields()] + ["ODC_BALANCE"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


def _args(**kw):
    base = {name: None for name, _, _ in training_args_fields()}
    base.update(kw)
    return SimpleNamespace(**base)


def test_members_are_the_plan_names_in_order():
    assert [member.value for member in PlanName] == list(PLANS) == ["free", "lockstep", "dynamic"]
    assert odc_accelerate.PlanName is PlanName
    assert all(type(name) is str for name in PLANS)


@pytest.mark.parametrize("name", PLANS)
def test_every_surface_parses_to_the_member(name, tmp_path):
    member = PlanName(name)
    dynamic = member is PlanName.DYNAMIC  # needs ODC on
    parsed = [
        ODCConfig(enable=True, plan=name).plan,
        ODCConfig(enable=True, plan=member).plan,
        ODCConfig.from_sources(overrides={"plan": name}, enable_default=True).plan,
        ODCConfig.from_sources(args=_args(odc=True, odc_plan=name)).plan,
        ODCConfig.from_sources(env={"ODC_ENABLE": "true", "ODC_PLAN": name}).plan,
        ODCConfig.from_sources(fsdp_config={"odc": True, "odc_plan": name}).plan,
        ODCConfig.from_sources(fsdp_config={"odc": {"enable": True, "plan": name}}).plan,
        normalize_plan(name),
        normalize_plan(member),
    ]
    fsdp_file = tmp_path / "fsdp.json"
    fsdp_file.write_text(json.dumps({"odc": True, "odc_plan": name}))
    parsed.append(ODCConfig.from_sources(fsdp_config=str(fsdp_file)).plan)
    if not dynamic:  # without ODC the plan alone balances plain FSDP2's steps
        parsed.append(ODCConfig.from_sources(env={"ODC_PLAN": name}).plan)
    assert all(plan is member for plan in parsed), parsed
    # The launcher carries the file's value to the workers as the plain name.
    assert env_from_fsdp_config({"odc": True, "odc_plan": member})["ODC_PLAN"] == name
    assert type(env_from_fsdp_config({"odc": True, "odc_plan": member})["ODC_PLAN"]) is str
    # Planning takes the member and the string alike.
    assert plan_step([5, 9, 3, 7], 2, 16, plan=member) == plan_step([5, 9, 3, 7], 2, 16, plan=name)


@pytest.mark.parametrize("name", PLANS)
def test_the_odc_plan_flag_and_recipe_key(name, tmp_path):
    from odc_accelerate.scripts.sft import make_parser

    _, args, _, _ = make_parser().parse_args_and_config(
        ["--output_dir", str(tmp_path), "--odc", "true", "--odc_plan", name], fail_with_unknown_args=False
    )
    assert args.odc_plan == name and ODCConfig.from_sources(args=args).plan is PlanName(name)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"odc: true\nodc_plan: {name}\n")
    _, args, _, _ = make_parser().parse_args_and_config(["--config", str(recipe)], fail_with_unknown_args=False)
    assert ODCConfig.from_sources(args=args).plan is PlanName(name)


@pytest.mark.parametrize("name", PLANS)
def test_the_accelerate_config_file_holds_the_plain_name(name):
    from odc_accelerate.cli.config import build_config

    text = yaml.safe_dump(build_config(device="cpu", num_processes=2, plan=name))
    assert f"odc_plan: {name}\n" in text
    fsdp_config = yaml.safe_load(text)["fsdp_config"]
    assert ODCConfig.from_sources(env=env_from_fsdp_config(fsdp_config)).plan is PlanName(name)


@pytest.mark.parametrize("name", PLANS)
def test_renders_as_the_plain_name(name):
    member = ODCConfig(enable=True, plan=name).plan
    logged = logging.LogRecord("odc", logging.WARNING, __file__, 0, "plan %s", (member,), None).getMessage()
    assert (str(member), f"{member}", format(member), f"{member:>9}", logged) == (
        name,
        name,
        name,
        f"{name:>9}",
        f"plan {name}",
    )
    assert repr(member) == f"{member!r}" == repr(name)
    assert json.dumps(member) == json.dumps(name)
    assert json.dumps({member: member}) == json.dumps({name: name})
    assert json.loads(json.dumps({"plan": member})) == {"plan": name}
    assert f"plan={name!r}" in repr(ODCConfig(enable=True, plan=name))


@pytest.mark.parametrize("name", PLANS)
def test_compares_as_the_old_string(name):
    member = PlanName(name)
    assert member == name and name == member and not member != name
    assert isinstance(member, str) and member in PLANS and hash(member) == hash(name)
    assert {name: 1}[member] == 1 and member in {name} and name in {member}
    assert [other for other in PLANS if other != member] == [other for other in PLANS if other != name]
    config = ODCConfig(enable=True, plan=name)
    assert config.plan == name and config.effective_plan == name
    reproducible = ODCConfig(enable=True, plan=name, reproducible=True).effective_plan
    assert reproducible is (PlanName.FREE if name == "dynamic" else member)


def test_bad_values_raise_the_same_message_naming_the_choices():
    choices = "choose one of 'free', 'lockstep', 'dynamic'"
    for bad in ("sync", "FREE", "PlanName.FREE", ""):
        with pytest.raises(ValueError, match=rf"^Unknown odc_plan \(ODC_PLAN\) {re.escape(repr(bad))}; {choices}\.$"):
            ODCConfig(enable=True, plan=bad)
    with pytest.raises(ValueError, match=rf"^Unknown odc_plan \(ODC_PLAN\) 'sync'; {choices}\.$"):
        ODCConfig.from_sources(env={"ODC_ENABLE": "true", "ODC_PLAN": "sync"})
    with pytest.raises(ValueError, match=rf"^Unknown plan 'sync'; {choices}\.$"):
        plan_step([1, 2], 1, plan="sync")


def test_the_old_spelling_still_converts():
    with pytest.warns(FutureWarning, match="odc_plan \\(ODC_PLAN\\) 'odc' is deprecated.*use 'free'"):
        assert ODCConfig(enable=True, plan="odc").plan is PlanName.FREE


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("free", "plan free, "),
        ("lockstep", "plan lockstep, "),
        ("dynamic", "plan dynamic (each rank claims the step's next microbatch when it is free"),
    ],
)
def test_the_banner_and_the_odc_off_warning_name_the_plan_as_before(name, shown, caplog):
    from odc_accelerate.engine.report import EngineReport
    from odc_accelerate.integrations.trainer.run import ODCRun
    from odc_accelerate.integrations.trainer.setup import ODCAcceleratorSetup

    report = EngineReport(
        transport="shm",
        transport_reason="auto: CPU tensors, every rank on one host",
        accumulate_path=None,
        accumulate_reason="",
        reduction="atomic",
        reduction_reason="auto: the shm transport adds atomically",
        param_groups=2,
        frozen=False,
        ranks=2,
        replicas=1,
        replicate_buckets=0,
        memory_policy="neither",
        memory="neither x2",
    )
    trainer = SimpleNamespace(
        odc_config=ODCConfig(enable=True, plan=name),
        odc_run=ODCRun(samples_per_step=4, folded_accumulation=1, max_tokens_per_microbatch=64),
        is_world_process_zero=lambda: True,
        odc_engine=SimpleNamespace(report=lambda: report),
        args=SimpleNamespace(world_size=2, per_device_train_batch_size=2),
        odc_plans_from_dataset=True,
    )
    with caplog.at_level(logging.WARNING, logger="odc_accelerate.integrations.trainer.setup"):
        ODCAcceleratorSetup._odc_banner(trainer)
    assert shown in caplog.text and "PlanName" not in caplog.text
    if name != "dynamic":
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="odc_accelerate.integrations.trainer.setup"):
            ODCAcceleratorSetup._odc_warn_if_off(SimpleNamespace(), ODCConfig.from_sources(env={"ODC_PLAN": name}))
        assert f"plain FSDP2 trains on the '{name}' plan's microbatches" in caplog.text
