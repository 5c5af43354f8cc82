import os
from pathlib import Path

import pytest
from integration_utils import SFT_PARITY, SFT_SAMPLES_PER_STEP, References, plain_env

from tests.helpers.infra import warm_start


@pytest.fixture(scope="session", autouse=True)
def warm_start_server():
    """The session's warm-start server (`tests/helpers/infra/warm_start.py`): the Python processes of the jobs these
    tests launch start as its forks. ODC_TEST_WARM_START=0 starts every one as a fresh interpreter."""
    if os.environ.get("ODC_TEST_WARM_START") == "0":
        yield None
        return
    yield warm_start.start(plain_env())
    warm_start.stop()


@pytest.fixture
def pid_dir(tmp_path):
    """A folder where worker processes write ``rank<r>.pid`` (see `odc_accelerate.testing.read_pids`)."""
    d = tmp_path / "pids"
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def references(tmp_path_factory) -> References:
    """The session's one-process TRL reference runs (`integration_utils.References`), each run once."""
    return References(tmp_path_factory.mktemp("references"))


@pytest.fixture(scope="session")
def sft_reference(references):
    """TRL's own SFTTrainer in one process on ``SFT_PARITY``, ``SFT_SAMPLES_PER_STEP`` samples per optimizer step
    (`tests/helpers/loops/trl_reference.py`): ``(process, output folder)``, run once for every SFT parity test."""
    future, out = references.start("sft", SFT_SAMPLES_PER_STEP, *SFT_PARITY, "--save_strategy", "no")
    return future.result(), out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(kind, hidden_size=64)``: the folder of a tiny model of ``kind`` ("tied": Llama 3.2-shaped with
    tied embeddings; "moe": Qwen3-MoE; see `odc_accelerate.testing.models.tiny_causal_lm_config`), saved with the
    offline tokenizer (seed 0), built once per session: what the scripts load with ``--model_name_or_path``."""
    from odc_accelerate.testing.models import save_tiny_causal_lm

    root = tmp_path_factory.mktemp("tiny_models")
    saved: dict[tuple[str, int], Path] = {}

    def get(kind: str, hidden_size: int = 64) -> Path:
        if (kind, hidden_size) not in saved:
            saved[kind, hidden_size] = save_tiny_causal_lm(
                kind, root / f"{kind}_{hidden_size}", hidden_size=hidden_size
            )
        return saved[kind, hidden_size]

    return get
