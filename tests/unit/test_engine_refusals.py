"""Engine checks that need no process group: a model FSDP2 did not shard is refused, and the exit handler only warns
when torch lacks what it releases."""

import pytest

from odc_accelerate.engine import ODCEngine
from odc_accelerate.testing.models import ToyConfig, build_model


def test_non_fsdp_model_is_refused_without_distributed():
    with pytest.raises(TypeError, match="fully_shard"):
        ODCEngine(build_model(ToyConfig()))


def test_release_at_exit_only_warns_about_a_missing_torch_internal(caplog, monkeypatch):
    """A torch whose DeviceMesh lacks what the release reads: the exit handler warns, naming it, and does not raise."""
    from odc_accelerate.engine import process_exit

    real = process_exit.compat.release_process_groups
    monkeypatch.setattr(process_exit.compat, "release_process_groups", lambda meshes: real([object(), *meshes]))
    with caplog.at_level("WARNING", logger=process_exit.__name__):
        process_exit.release_process_groups_at_exit()  # no process group in this process, as after destroy_process_group()
    assert "DeviceMesh._pg_registry" in caplog.text and "outlive destroy_process_group" in caplog.text
