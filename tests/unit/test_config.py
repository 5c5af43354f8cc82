"""`ODCConfig`: one definition of every option, resolved from arguments > fsdp_config > environment > defaults."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest

from odc_accelerate.config import ODCConfig, env_from_fsdp_config, option_fields, training_args_fields
from odc_accelerate.validation import check_positive_int, str_to_bool

ENV_NAMES = [f.metadata["env"] for f in option_fields()] + ["ODC_BALANCE"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


def _args(**kw):
    """Training arguments as the TRL configs carry them: every key present, None = not set."""
    base = {name: None for name, _, _ in training_args_fields()}
    base.update(kw)
    return SimpleNamespace(**base)


def test_every_option_has_one_key_env_and_help():
    keys = [f.metadata["key"] for f in option_fields()]
    envs = [f.metadata["env"] for f in option_fields()]
    assert len(set(keys)) == len(keys) and len(set(envs)) == len(envs)
    assert keys[0] == "odc" and all(k.startswith("odc_") for k in keys[1:])
    assert all(e.startswith("ODC_") for e in envs)
    assert all(f.metadata["help"] for f in option_fields())
    # The training-argument fields are generated from the same list (plus the deprecated spellings).
    assert [name for name, _, _ in training_args_fields()][: len(keys)] == keys


def test_off_by_default():
    config = ODCConfig.from_sources(args=_args())
    assert not config.enable and not config.balanced and config.source == "default"
    assert (config.transport, config.timeout, config.plan) == ("auto", 600.0, None)


def test_odc_on_plans_free_by_default():
    config = ODCConfig.from_sources(args=_args(odc=True))
    assert config.enable and config.plan == "free" and config.balanced and config.source == "args"


def test_plan_alone_runs_plain_fsdp2_on_balanced_steps():
    config = ODCConfig.from_sources(args=_args(odc_plan="lockstep"))
    assert not config.enable and config.balanced and config.plan == "lockstep"


def test_fsdp_config_section_flat_keys_and_file(tmp_path):
    config = ODCConfig.from_sources(
        args=_args(fsdp_config={"odc": {"enable": True, "transport": "shm", "timeout": 5}})
    )
    assert (config.enable, config.source, config.transport, config.timeout) == (True, "fsdp_config", "shm", 5.0)
    config = ODCConfig.from_sources(args=_args(fsdp_config={"odc": True, "odc_max_tokens_per_microbatch": 512}))
    assert (config.enable, config.max_tokens_per_microbatch) == (True, 512)
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"fsdp_version": 2, "odc": {"enable": True, "plan": "lockstep"}}))
    config = ODCConfig.from_sources(args=_args(fsdp_config=str(path)))  # TrainingArguments leaves it a path
    assert (config.enable, config.plan) == (True, "lockstep")


def test_precedence_args_over_fsdp_config_over_env(monkeypatch):
    monkeypatch.setenv("ODC_ENABLE", "true")
    monkeypatch.setenv("ODC_TRANSPORT", "network")
    monkeypatch.setenv("ODC_TIMEOUT", "7")
    config = ODCConfig.from_sources(args=_args())
    assert (config.enable, config.source, config.transport, config.timeout) == (True, "env", "network", 7.0)
    config = ODCConfig.from_sources(args=_args(fsdp_config={"odc": {"transport": "shm"}}))
    assert (config.enable, config.transport) == (True, "shm")
    config = ODCConfig.from_sources(args=_args(odc=False, fsdp_config={"odc": True}))
    assert not config.enable and config.source == "args"  # an explicit --odc false wins over file and environment


def test_overrides_and_enable_default(monkeypatch):
    monkeypatch.setenv("ODC_TRANSPORT", "network")
    config = ODCConfig.from_sources(overrides={"transport": "shm", "timeout": None}, enable_default=True)
    assert (config.enable, config.transport, config.timeout, config.source) == (True, "shm", 600.0, "default")
    with pytest.raises(TypeError, match="Unknown ODC option"):
        ODCConfig.from_sources(overrides={"balance": "free"})


def test_telemetry_switches_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ODC_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("ODC_TIME_COLLECTIVES", "1")
    config = ODCConfig.from_sources(args=_args())
    assert (config.trace_dir, config.time_collectives) == (str(tmp_path), True)


def test_memory_policy_on_every_surface(monkeypatch):
    assert (ODCConfig().memory_policy, ODCConfig().memory_headroom) == ("neither", "30%")  # the defaults
    monkeypatch.setenv("ODC_MEMORY_POLICY", "Both")
    monkeypatch.setenv("ODC_MEMORY_HEADROOM", "4GiB")
    from_env = ODCConfig.from_sources(args=_args())
    assert (from_env.memory_policy, from_env.memory_headroom) == ("both", "4gib")
    from_file = ODCConfig.from_sources(args=_args(fsdp_config={"odc_memory_policy": "<root>=params,blocks.*=grads"}))
    assert from_file.memory_policy == "<root>=params,blocks.*=grads"  # patterns keep their case
    assert ODCConfig.from_sources(args=_args(odc_memory_policy="auto")).memory_policy == "auto"  # args win


def test_reduction_from_every_source(monkeypatch):
    from odc_accelerate.reduction import REDUCTIONS, ReductionName

    assert REDUCTIONS == ("auto", "atomic", "ordered")  # the default first
    default = ODCConfig.from_sources(args=_args(odc=True))
    assert default.reduction == "auto" and default.reduction is ReductionName.AUTO and "reduction" not in default.given
    assert ODCConfig(reduction=ReductionName.ORDERED).reduction == "ordered"  # Python: the enum or its name
    monkeypatch.setenv("ODC_REDUCTION", "ordered")
    from_env = ODCConfig.from_sources(args=_args(odc=True))
    assert (from_env.reduction, from_env.given["reduction"]) == ("ordered", "env")
    # an fsdp_config key (flat or in the odc section) wins over the environment, an argument over both
    for fsdp_config in ({"odc_reduction": "atomic"}, {"odc": {"enable": True, "reduction": "atomic"}}):
        from_file = ODCConfig.from_sources(args=_args(odc=True, fsdp_config=fsdp_config))
        assert (from_file.reduction, from_file.given["reduction"]) == ("atomic", "fsdp_config")
    from_args = ODCConfig.from_sources(
        args=_args(odc=True, odc_reduction="ordered", fsdp_config={"odc_reduction": "atomic"})
    )
    assert (from_args.reduction, from_args.given["reduction"]) == ("ordered", "args")
    # the plugin's constructor keywords (overrides) and the launcher's export of a config file
    assert (
        ODCConfig.from_sources(overrides={"reduction": "atomic"}, env={"ODC_REDUCTION": "ordered"}).reduction
        == "atomic"
    )
    assert env_from_fsdp_config({"odc": True, "odc_reduction": "ordered"})["ODC_REDUCTION"] == "ordered"
    # the training-argument field and its flag, typed as a string
    (field_type,) = [kind for name, kind, _ in training_args_fields() if name == "odc_reduction"]
    assert field_type == str | None


@pytest.mark.parametrize("value", ["Ordered", "sorted", " ordered", "", 1, True])
def test_bad_reductions_name_the_option_and_the_accepted_values(value):
    with pytest.raises(ValueError) as err:
        ODCConfig.from_sources(overrides={"reduction": value}, env={})
    assert str(err.value) == f"odc_reduction (ODC_REDUCTION) must be one of auto, atomic, ordered, got {value!r}."


def test_the_launchers_env_resolves_like_the_file_it_came_from():
    fsdp_config = {"odc": True, "odc_transport": "shm", "odc_timeout": 12.5, "odc_plan": "lockstep"}
    fsdp_config["odc_max_tokens_per_microbatch"] = 2048
    via_env = ODCConfig.from_sources(env=env_from_fsdp_config(fsdp_config))
    via_file = ODCConfig.from_sources(fsdp_config=fsdp_config, env={})
    assert via_env.options() == via_file.options() and (via_env.source, via_file.source) == ("env", "fsdp_config")
    assert (via_env.transport, via_env.timeout, via_env.max_tokens_per_microbatch) == ("shm", 12.5, 2048)


def test_env_from_fsdp_config_exports_only_what_the_file_sets():
    env = env_from_fsdp_config({"fsdp_version": 2, "odc": True, "odc_transport": "auto", "odc_plan": "free"})
    assert env == {"ODC_ENABLE": "true", "ODC_TRANSPORT": "auto", "ODC_PLAN": "free"}
    with pytest.raises(ValueError, match="Unknown ODC key 'odc_planz'.*odc_plan"):
        env_from_fsdp_config({"odc_planz": "free"})
    with pytest.raises(ValueError, match="Unknown key 'speed' in fsdp_config's odc section"):
        env_from_fsdp_config({"odc": {"speed": 1}})


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(odc=True, odc_transport="udp"), r"Unknown odc_transport \(ODC_TRANSPORT\) 'udp'"),
        (dict(odc=True, odc_plan="greedy"), "greedy"),
        (dict(odc=True, odc_timeout=0), "odc_timeout .* must be a positive number"),
        (dict(odc=True, odc_timeout="soon"), "odc_timeout .* must be a positive number"),
        (dict(odc=True, odc_max_tokens_per_microbatch=0), "odc_max_tokens_per_microbatch .* positive integer"),
        (dict(odc=True, odc_samples_per_step=2.5), "odc_samples_per_step .* positive integer"),
        (dict(fsdp_config={"odc": "maybe"}), "fsdp_config's odc must be a boolean"),
        (dict(odc="perhaps"), r"odc \(ODC_ENABLE\) must be a boolean"),
        (dict(odc=True, odc_memory_policy="most"), r"odc_memory_policy \(ODC_MEMORY_POLICY\): memory policy 'most'"),
        (dict(odc=True, odc_memory_headroom="lots"), r"odc_memory_headroom \(ODC_MEMORY_HEADROOM\): .*'30%'"),
    ],
)
def test_bad_values_name_the_option(kw, message):
    with pytest.raises(ValueError, match=message):
        ODCConfig.from_sources(args=_args(**kw))


def test_deprecated_spellings_warn_and_work(monkeypatch, tmp_path):
    with pytest.warns(FutureWarning, match="--odc_balance is deprecated.*--odc_plan"):
        config = ODCConfig.from_sources(args=_args(odc=True, odc_balance="lockstep"))
    assert config.plan == "lockstep"
    with pytest.warns(FutureWarning, match="'odc'"):
        assert ODCConfig.from_sources(args=_args(odc=True, odc_plan="odc")).plan == "free"
    monkeypatch.setenv("ODC_BALANCE", "lockstep")
    with pytest.warns(FutureWarning, match="ODC_BALANCE is deprecated.*ODC_PLAN"):
        assert ODCConfig.from_sources(args=_args(odc=True)).plan == "lockstep"
    monkeypatch.delenv("ODC_BALANCE")
    with pytest.warns(FutureWarning, match="odc_balance is deprecated"):
        assert env_from_fsdp_config({"odc_balance": "lockstep"}) == {"ODC_PLAN": "lockstep"}
    with pytest.warns(FutureWarning, match="odc.balance is deprecated"):
        assert ODCConfig.from_sources(fsdp_config={"odc": {"balance": "lockstep"}}).plan == "lockstep"
    # The new spelling alone warns nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ODCConfig.from_sources(args=_args(odc=True, odc_plan="lockstep")).plan == "lockstep"


def test_shared_parsers():
    assert [str_to_bool(v) for v in ("1", "TRUE", "on", True, "0", "off", False)] == [True] * 4 + [False] * 3
    with pytest.raises(ValueError, match="flag must be a boolean"):
        str_to_bool("2", "flag")
    assert check_positive_int("8", "n") == 8 and check_positive_int(3.0, "n") == 3
    for bad in (0, -1, True, 1.5, "x", None):
        with pytest.raises(ValueError, match="n must be a positive integer"):
            check_positive_int(bad, "n")


def test_dynamic_plan_needs_odc_and_reproducible_falls_back_to_free():
    from odc_accelerate.config import ODCConfig

    config = ODCConfig(enable=True, plan="dynamic")
    assert (config.plan, config.effective_plan, config.reproducible) == ("dynamic", "dynamic", False)
    fallback = ODCConfig.from_sources(env={"ODC_ENABLE": "true", "ODC_PLAN": "dynamic", "ODC_REPRODUCIBLE": "1"})
    assert (fallback.plan, fallback.effective_plan, fallback.given["reproducible"]) == ("dynamic", "free", "env")
    assert ODCConfig(enable=True, plan="lockstep", reproducible=True).effective_plan == "lockstep"
    with pytest.raises(ValueError, match=r"odc_plan \(ODC_PLAN\) 'dynamic' needs ODC"):
        ODCConfig(plan="dynamic")
