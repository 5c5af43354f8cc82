"""How the ODC trainer resolves its settings: training arguments > fsdp_config section > ODC_* environment."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("trl")

from odc_accelerate.integrations.trainer import resolve_odc_options  # noqa: E402


def _args(**kw):
    base = dict(odc=None, odc_transport=None, odc_timeout=None, odc_max_tokens_per_microbatch=None, odc_balance=None)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("ODC_ENABLE", "ODC_TRANSPORT", "ODC_TIMEOUT", "ODC_MAX_TOKENS_PER_MICROBATCH", "ODC_BALANCE"):
        monkeypatch.delenv(name, raising=False)


def test_off_by_default():
    opts = resolve_odc_options(_args())
    assert not opts.odc and not opts.balanced and opts.source == "off"


def test_balance_alone_runs_plain_fsdp2_on_balanced_steps():
    opts = resolve_odc_options(_args(odc_balance="lockstep"))
    assert not opts.odc and opts.balanced and opts.balance == "lockstep"


def test_fsdp_config_section_dict_flat_and_file(tmp_path):
    opts = resolve_odc_options(_args(fsdp_config={"odc": {"enable": True, "transport": "shm", "timeout": 5}}))
    assert (opts.odc, opts.source, opts.transport, opts.timeout) == (True, "fsdp_config", "shm", 5.0)
    opts = resolve_odc_options(_args(fsdp_config={"odc": True, "odc_max_tokens_per_microbatch": 512}))
    assert (opts.odc, opts.max_tokens_per_microbatch) == (True, 512)
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"fsdp_version": 2, "odc": {"enable": True, "balance": "lockstep"}}))
    opts = resolve_odc_options(_args(fsdp_config=str(path)))  # TrainingArguments leaves it a path without --fsdp
    assert (opts.odc, opts.balance) == (True, "lockstep")


def test_precedence_args_over_fsdp_config_over_env(monkeypatch):
    monkeypatch.setenv("ODC_ENABLE", "true")
    monkeypatch.setenv("ODC_TRANSPORT", "network")
    monkeypatch.setenv("ODC_TIMEOUT", "7")
    opts = resolve_odc_options(_args())
    assert (opts.odc, opts.source, opts.transport, opts.timeout) == (True, "env", "network", 7.0)
    opts = resolve_odc_options(_args(fsdp_config={"odc": {"transport": "shm"}}))
    assert (opts.odc, opts.transport) == (True, "shm")
    opts = resolve_odc_options(_args(odc=False, fsdp_config={"odc": True}))
    assert not opts.odc  # an explicit --odc false wins over the file and the environment


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(odc=True, odc_transport="udp"), "unknown ODC transport 'udp'"),
        (dict(odc=True, odc_balance="greedy"), "unknown ODC balance mode 'greedy'"),
        (dict(odc=True, odc_timeout=0), "timeout must be a positive number"),
        (dict(odc=True, odc_max_tokens_per_microbatch=0), "token budget per microbatch must be a positive integer"),
        (dict(fsdp_config={"odc": "maybe"}), "fsdp_config.odc must be a boolean"),
    ],
)
def test_bad_values_name_the_option(kw, message):
    with pytest.raises(ValueError, match=message):
        resolve_odc_options(_args(**kw))
