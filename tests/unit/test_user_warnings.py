"""The warnings a user can meet, each with its trigger and its absence: ODC asked for but off, and TRL metrics kept
local when a trainer's gathers differ from the tested order. (Untested versions: `test_compat.py`; samples over the
token budget: the SFT integration tests.)"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from odc_accelerate.config import ODCConfig
from odc_accelerate.integrations.trainer.setup import ODCAcceleratorSetup
from odc_accelerate.integrations.trl.dpo import ODCDPOTrainer
from odc_accelerate.integrations.trl.grpo import ODCGRPOTrainer

SETUP_LOGGER = "odc_accelerate.integrations.trainer.setup"


@pytest.fixture(autouse=True)
def _no_odc_env(monkeypatch):
    for name in ("ODC_ENABLE", "ODC_PLAN", "ODC_TRANSPORT"):
        monkeypatch.delenv(name, raising=False)


def _warn_if_off(config: ODCConfig, caplog) -> str:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=SETUP_LOGGER):
        ODCAcceleratorSetup._odc_warn_if_off(SimpleNamespace(), config)
    return caplog.text


def test_settings_given_while_odc_is_off_warn_naming_them_and_their_source(caplog):
    config = ODCConfig.from_sources(env={"ODC_TRANSPORT": "shm", "ODC_PLAN": "lockstep"})
    assert not config.enable
    text = _warn_if_off(config, caplog)
    assert "ODC is OFF for this run (odc is not set)" in text
    assert "odc_plan (env), odc_transport (env)" in text
    assert "plain FSDP2 trains on the 'lockstep' plan's microbatches" in text
    assert "Set --odc true" in text


def test_odc_switched_off_by_an_argument_against_the_environment_warns(caplog, monkeypatch):
    monkeypatch.setenv("ODC_ENABLE", "true")
    config = ODCConfig.from_sources(args=SimpleNamespace(odc=False))
    assert not config.enable and config.source == "args"
    text = _warn_if_off(config, caplog)
    assert "ODC is OFF for this run (odc=false from args)" in text and "ODC_ENABLE=true (env)" in text


def test_no_odc_setting_no_warning(caplog):
    assert _warn_if_off(ODCConfig.from_sources(env={}), caplog) == ""


def _metrics_warning(trainer_class, fake, caplog) -> str:
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        trainer_class._odc_finalize_metrics(fake, SimpleNamespace(gathers_per_microbatch=3))
    return caplog.text


def test_dpo_metrics_stay_local_when_trl_gathers_differently(caplog):
    fake = SimpleNamespace(aux_loss_enabled=False)
    text = _metrics_warning(ODCDPOTrainer, fake, caplog)
    assert "DPO made 3 metric gathers per microbatch, expected 15" in text and "metrics of this step are local" in text


def test_grpo_metrics_stay_local_when_trl_reduces_differently(caplog):
    fake = SimpleNamespace(beta=0.0, loss_type="grpo")
    text = _metrics_warning(ODCGRPOTrainer, fake, caplog)
    assert "GRPO made 3 metric reductions per microbatch, expected 6" in text
    assert "the loss metrics of this step are local" in text


def test_launch_refusal_names_what_an_installed_package_offers(monkeypatch):
    """The refusal of a launch without FSDP names the package's presets and config writer, not files of a clone."""
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    trainer = SimpleNamespace(odc_config=ODCConfig(enable=True), args=SimpleNamespace(fsdp_plugin_args=None))
    with pytest.raises(ValueError) as err:
        ODCAcceleratorSetup._build_accelerator_args(trainer)
    message = str(err.value)
    assert "ODC needs FSDP2, but this run does not use FSDP" in message
    assert "--accelerate_config odc_cpu|odc_gpu" in message and "`odc-accelerate config`" in message
    assert "examples/" not in message


def test_no_package_text_names_a_file_of_the_clone():
    """pip users have no examples/ folder: no message, docstring or help text of the package names one."""
    from pathlib import Path

    import odc_accelerate

    package = Path(odc_accelerate.__file__).parent
    naming = [str(p.relative_to(package)) for p in package.rglob("*.py") if "examples/" in p.read_text()]
    assert naming == []
