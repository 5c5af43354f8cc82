"""accelerate integration: FSDP2 on CPU, `ODCPlugin` in a custom loop, `odc-accelerate launch`, bad configs.

Real ``accelerate launch`` jobs with 2 CPU processes (gloo) on `tests/helpers/loops/accelerate_loop.py`.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from integration_utils import CONFIGS, LOOP, accelerate_launch, check_ok, reports, run, shm_leftovers

pytestmark = pytest.mark.filterwarnings("ignore")


def _params(report: dict) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=np.float64) for k, v in report["params"].items()}


def _max_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max() / (np.abs(b[k]).max() + 1e-12)) for k in a)


def test_odc_plugin_unequal_counts_match_single_process(tmp_path):
    """Accelerator(fsdp_plugin=ODCPlugin()): ranks run 1 and 3 microbatches; weights equal one process's."""
    before = shm_leftovers()
    odc, single = tmp_path / "odc", tmp_path / "single"
    check_ok(accelerate_launch(CONFIGS / "fsdp2_cpu.yaml", LOOP, "--out", odc, "--counts", "1,3", "--plugin", "odc"))
    check_ok(run([sys.executable, LOOP, "--out", single, "--counts", "1,3", "--single"]))
    ranks = reports(odc, "result_rank")
    assert len(ranks) == 2
    for r in ranks:  # asserted from inside each process
        assert r["distributed_type"] == "DistributedType.FSDP"
        assert r["plugin"] == "ODCPlugin" and r["fsdp_version"] == 2
        assert r["engine"] == "ODCEngine" and r["transport"] == "ShmTransport"
        assert r["device"].startswith("cpu")
    ref = reports(single, "result_rank")[0]
    assert ref["engine"] is None
    # losses: each rank logs its share of the global token mean; their sum is the single-process loss
    total = np.sum([r["losses"] for r in ranks], axis=0)
    np.testing.assert_allclose(total, ref["losses"], rtol=1e-5)
    # Usually bit-identical; but peers add into an owner's accumulator in arrival order, so fp32 rounding differs
    # from run to run, and AdamW turns rounding noise in near-zero gradient entries into update noise (one run in
    # many measured 1.2e-5). A wrong loss weighting of the 1-vs-3 microbatches would move weights by ~lr (1e-2).
    assert _max_rel(_params(ranks[0]), _params(ref)) <= 1e-4
    assert _max_rel(_params(ranks[0]), _params(ranks[1])) == 0.0
    assert shm_leftovers() <= before, "shared memory left behind"


@pytest.mark.parametrize(("plugin", "counts"), [("fsdp2", "2,2"), ("odc", "1,3")])
def test_end_training_lets_gloo_join_its_workers_before_the_interpreter_exits(tmp_path, plugin, counts):
    """After ``end_training`` no gloo worker thread is left when the interpreter finalises.

    A gloo worker still alive then can abort a finished run (SIGABRT at exit, 1 run in ~40 under load); this checks
    the cause deterministically. The model stays referenced until exit, like a trainer kept in a script's global.
    """
    out = tmp_path / "run"
    args = ("--out", out, "--counts", counts, "--plugin", plugin, "--steps", "1", "--thread-report")
    check_ok(accelerate_launch(CONFIGS / "fsdp2_cpu.yaml", LOOP, *args))
    ranks = reports(out, "threads_rank")
    assert len(ranks) == 2
    for r in ranks:
        # the check can see gloo's workers: they run while the group exists
        assert "pt_gloo_runloop" in r["before_end_training"], r
        assert not [t for t in r["at_exit"] if t.startswith(("pt_gloo", "gloo_"))], r


def test_launcher_env_path_and_bf16_identical_to_fsdp2(tmp_path):
    """`odc-accelerate launch` exports the config's odc keys; a plain Accelerator() then gets the ODC engine.

    With equal microbatch counts and bf16 mixed precision, ODC and plain FSDP2 weights are bit-identical.
    """
    odc, plain = tmp_path / "odc", tmp_path / "plain"
    check_ok(
        accelerate_launch(
            CONFIGS / "odc_cpu.yaml",
            LOOP,
            "--out",
            odc,
            "--counts",
            "1,1",
            "--plugin",
            "env",
            launcher="odc",
            ACCELERATE_MIXED_PRECISION="bf16",
        )
    )
    check_ok(
        accelerate_launch(
            CONFIGS / "fsdp2_cpu.yaml",
            LOOP,
            "--out",
            plain,
            "--counts",
            "1,1",
            "--plugin",
            "env",
            ACCELERATE_MIXED_PRECISION="bf16",
        )
    )
    a, b = reports(odc, "result_rank"), reports(plain, "result_rank")
    assert [r["engine"] for r in a] == ["ODCEngine", "ODCEngine"]
    assert [r["plugin"] for r in a] == ["ODCPlugin", "ODCPlugin"]
    assert [r["engine"] for r in b] == [None, None]
    assert [r["distributed_type"] for r in a + b] == ["DistributedType.FSDP"] * 4
    assert a[0]["losses"] == b[0]["losses"] and a[1]["losses"] == b[1]["losses"]
    assert _max_rel(_params(a[0]), _params(b[0])) == 0.0


def test_launcher_reads_config_keys_and_rejects_bad_ones(tmp_path):
    from odc_accelerate.launch import odc_env_from_config

    env = odc_env_from_config(str(CONFIGS / "odc_cpu.yaml"))
    assert env == {"ODC_ENABLE": "true", "ODC_TRANSPORT": "auto", "ODC_PLAN": "free"}
    assert odc_env_from_config(str(CONFIGS / "fsdp2_cpu.yaml")) == {}

    text = (CONFIGS / "odc_cpu.yaml").read_text()
    fsdp1 = tmp_path / "fsdp1.yaml"
    fsdp1.write_text(text.replace("fsdp_version: 2", "fsdp_version: 1"))
    proc = run(
        [sys.executable, "-m", "odc_accelerate.launch", "launch", "--config_file", fsdp1, LOOP, "--out", tmp_path]
    )
    assert proc.returncode == 2
    assert "asks for ODC (odc: true) but not FSDP2" in proc.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("odc_transport: auto", "odc_transport: carrier_pigeon"))
    proc = run(
        [sys.executable, "-m", "odc_accelerate.launch", "launch", "--config_file", bad, LOOP, "--out", tmp_path]
    )
    assert proc.returncode == 2 and "Unknown odc_transport (ODC_TRANSPORT) 'carrier_pigeon'" in proc.stderr
    typo = tmp_path / "typo.yaml"
    typo.write_text(text.replace("odc_plan: free", "odc_plam: free"))
    with pytest.raises(ValueError, match="Unknown ODC key 'odc_plam'"):
        odc_env_from_config(str(typo))
