import pytest
from integration_utils import SFT_PARITY, SFT_SAMPLES_PER_STEP, trl_reference


@pytest.fixture
def pid_dir(tmp_path):
    """A folder where worker processes write ``rank<r>.pid`` (see `odc_accelerate.testing.read_pids`)."""
    d = tmp_path / "pids"
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def sft_reference(tmp_path_factory):
    """TRL's own SFTTrainer in one process on ``SFT_PARITY``, ``SFT_SAMPLES_PER_STEP`` samples per optimizer step
    (`tests/helpers/trl_reference.py`): ``(process, output folder)``, run once for every SFT parity test."""
    out = tmp_path_factory.mktemp("sft_reference")
    proc = trl_reference("sft", SFT_SAMPLES_PER_STEP, *SFT_PARITY, "--save_strategy", "no", output_dir=out)
    return proc, out
