import pytest


@pytest.fixture
def pid_dir(tmp_path):
    """A folder where worker processes write ``rank<r>.pid`` (see `odc_accelerate.testing.read_pids`)."""
    d = tmp_path / "pids"
    d.mkdir()
    return d
