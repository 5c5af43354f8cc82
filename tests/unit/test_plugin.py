"""`ODCPlugin` in one process: bad input, environment fallbacks, and the teardown's message when torch lacks an
internal."""

import pytest


def test_plugin_bad_input():
    from odc_accelerate.integrations.accelerate import ODCPlugin
    from odc_accelerate.transport import TRANSPORTS

    with pytest.raises(
        ValueError, match=r"Unknown odc_transport \(ODC_TRANSPORT\) 'bogus'; choose one of " + ", ".join(TRANSPORTS)
    ):
        ODCPlugin(transport="bogus")
    with pytest.raises(ValueError, match="ODC runs on FSDP2 only, got fsdp_version=1"):
        ODCPlugin(fsdp_version=1)
    with pytest.raises(ValueError, match="'fast'"):
        ODCPlugin(plan="fast")
    with pytest.raises(ValueError, match="odc_max_tokens_per_microbatch .* must be a positive integer"):
        ODCPlugin(max_tokens_per_microbatch=0)
    plugin = ODCPlugin()
    assert plugin.fsdp_version == 2 and plugin.enable is True and plugin.transport == "auto" and plugin.plan == "free"
    with pytest.warns(FutureWarning, match=r"ODCPlugin\(balance=...\) is deprecated"):
        assert ODCPlugin(balance="lockstep").plan == "lockstep"
    with pytest.warns(FutureWarning, match=r"ODCPlugin\(odc=...\) is deprecated"):
        assert ODCPlugin(odc=False).enable is False


def test_release_after_end_training_names_a_missing_torch_internal(caplog):
    """A torch whose DeviceMesh lacks what the teardown reads: an error naming it; end_training only warns."""
    from types import SimpleNamespace

    from odc_accelerate._compat import CompatError
    from odc_accelerate._compat.torch import c10d as c10d_compat
    from odc_accelerate.integrations import accelerate as integration

    with pytest.raises(CompatError, match="DeviceMesh._pg_registry"):
        c10d_compat.release_process_groups([object()])
    # no process group in this process, as after destroy_process_group()
    fake = SimpleNamespace(state=SimpleNamespace(device_mesh=object()))
    with caplog.at_level("WARNING", logger=integration.__name__):
        integration._release_process_groups(fake)
    assert "DeviceMesh._pg_registry" in caplog.text and "outlive end_training" in caplog.text


def test_plugin_env_fallbacks(monkeypatch):
    from odc_accelerate.integrations.accelerate import ODCPlugin

    monkeypatch.setenv("ODC_TRANSPORT", "shm")
    monkeypatch.setenv("ODC_TIMEOUT", "12.5")
    monkeypatch.setenv("ODC_MAX_TOKENS_PER_MICROBATCH", "2048")
    monkeypatch.setenv("ODC_PLAN", "lockstep")
    p = ODCPlugin()
    assert (p.transport, p.timeout, p.max_tokens_per_microbatch, p.plan) == ("shm", 12.5, 2048, "lockstep")
    assert p.source == "default"  # enable was not set anywhere: the plugin's own default
    assert ODCPlugin(transport="network").transport == "network"  # explicit beats the environment


def test_end_training_closes_the_engines_when_a_callback_before_it_fails(monkeypatch):
    """A before-end callback that raises (e.g. vLLM's shutdown) skips neither the later callbacks nor closing the ODC
    engines (the trained model's and the frozen ones); its error is raised once they are closed."""
    from odc_accelerate.integrations import accelerate as integration

    class Engine:
        def __init__(self) -> None:
            self.closed = False

        def close(self) -> None:
            self.closed = True

    class Accelerator:  # the key the engines are registered under (weakly referenced)
        pass

    accelerator, engine, frozen = Accelerator(), Engine(), Engine()
    monkeypatch.setitem(integration._ENGINES, accelerator, engine)
    monkeypatch.setitem(integration._FROZEN_ENGINES, accelerator, [frozen])
    calls = []

    def shutdown() -> None:
        calls.append("shutdown")
        raise RuntimeError("vLLM engine shutdown failed")

    integration.call_before_end_training(accelerator, shutdown)
    integration.call_before_end_training(accelerator, lambda: calls.append("next callback"))
    with pytest.raises(RuntimeError, match="vLLM engine shutdown failed"):
        integration._close_engine(accelerator)
    assert engine.closed and frozen.closed
    assert calls == ["shutdown", "next callback"]
    assert accelerator not in integration._ENGINES and accelerator not in integration._FROZEN_ENGINES
