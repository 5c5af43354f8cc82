"""An unmodified accelerate loop (`tests/helpers/loops/clm_no_trainer.py`, shaped as transformers'
``run_clm_no_trainer.py``) under ``odc-accelerate launch`` on 2 CPU processes, ODC on and off.

* With the package's ``odc_cpu`` config, accelerate's own ``clip_grad_norm_`` / ``optimizer.step`` make the engine's
  step calls: the weights move, every loss and the final weights equal plain FSDP2's on the same samples (gradient
  accumulation 2 through ``accelerator.accumulate``, so FSDP2's ``no_sync`` microbatches too), and the ODC banner is
  printed once.
* With ``even_batches=False`` the ranks run 2 and 1 microbatches in the last step (plain FSDP2 cannot pair its
  collectives then): the weights equal one process trained on the microbatches the ranks recorded.
* With ``odc: false`` the same launch is one FSDP2 job over gloo (world size 2, half the parameters per rank), not one
  model per process.
* ``sync_each_batch=True`` with ``odc_memory_policy auto`` is refused when the engine attaches, on both ranks, though
  only rank 0's free memory would let ``auto`` keep gradients.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from integration_utils import ROOT, RUN_EXAMPLE, background, base_env, check_ok, reports, results, run, shm_leftovers

pytestmark = pytest.mark.filterwarnings("ignore")

SCRIPT = ROOT / "tests" / "helpers" / "loops" / "clm_no_trainer.py"
ODC_CPU = ROOT / "odc_accelerate" / "cli" / "accelerate_configs" / "odc_cpu.yaml"
LAUNCH = [sys.executable, "-m", "odc_accelerate.launch", "launch", "--main_process_port", "0"]
BANNER = "ODC on: 4 param groups, transport shm"


def _launch(config: Path, out: Path, *args: str, script: list | None = None, **env: str):
    cmd = [*LAUNCH, "--config_file", config, *(script or [SCRIPT]), "--out", out, *args]
    return run(cmd, env=base_env(**env), timeout=300)


def _params(report: dict, key: str = "params") -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=np.float64) for k, v in report[key].items()}


def _max_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max() / (np.abs(b[k]).max() + 1e-12)) for k in a)


def _max_change(report: dict) -> float:
    a, b = _params(report), _params(report, "initial")
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def _losses(report: dict) -> list[list[float]]:
    return [[mb["loss"] for mb in step] for step in report["steps"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("accelerate_loop")
    shm_before = shm_leftovers()
    off = root / "odc_off.yaml"
    off.write_text(ODC_CPU.read_text().replace("  odc: true", "  odc: false"))
    assert "odc: false" in off.read_text()
    out = {name: root / name for name in ("odc", "plain", "uneven", "refused")}
    jobs = {
        "odc": background(_launch, ODC_CPU, out["odc"]),
        "plain": background(_launch, off, out["plain"]),
        "uneven": background(_launch, ODC_CPU, out["uneven"], "--samples", "14", "--uneven"),
        # rank 0 reads 1 TiB free (auto keeps every gradient), rank 1 1 MiB (auto keeps nothing)
        "refused": background(
            _launch,
            ODC_CPU,
            out["refused"],
            "--sync_each_batch",
            script=[RUN_EXAMPLE, SCRIPT],
            ODC_MEMORY_POLICY="auto",
            ODC_TEST_FREE_MEMORY="1TiB,1MiB",
        ),
    }
    procs = results(jobs)
    for name in ("odc", "uneven"):
        if procs[name].returncode == 0:
            replay = root / f"{name}_replay"
            procs[f"{name}_replay"] = run([sys.executable, SCRIPT, "--out", replay, "--replay", out[name]])
            out[f"{name}_replay"] = replay
    return {"procs": procs, "out": out, "shm_before": shm_before}


def test_unmodified_loop_trains_with_odc_as_plain_fsdp2(runs):
    procs, out = runs["procs"], runs["out"]
    check_ok(procs["odc"])
    check_ok(procs["plain"])
    odc, plain = reports(out["odc"], "result_rank"), reports(out["plain"], "result_rank")
    assert [r["plugin"] for r in odc] == ["ODCPlugin", "ODCPlugin"]
    assert [r["optimizer_steps"] for r in odc] == [3, 3]
    assert [[len(s) for s in r["steps"]] for r in odc] == [[2, 2, 2]] * 2  # gradient_accumulation_steps 2
    # Without the engine's step calls every gradient reaches the optimizer as zero and no weight moves.
    assert _max_change(odc[0]) > 1e-3
    for a, b in zip(odc, plain, strict=True):
        assert a["steps"] == b["steps"]  # same samples, same losses, microbatch by microbatch
    assert _max_rel(_params(odc[0]), _params(plain[0])) <= 1e-5  # measured: 0.0 (bit-identical)
    assert _max_rel(_params(odc[0]), _params(odc[1])) == 0.0
    # The one-line banner, once (rank 0), naming how the step calls are made.
    assert procs["odc"].stderr.count(BANNER) == 1, procs["odc"].stderr[-3000:]
    assert "Step calls follow accelerate's" in procs["odc"].stderr
    assert BANNER not in procs["plain"].stderr
    # And one process on the recorded microbatches (AdamW turns fp32 rounding into update noise: measured 1.9e-5).
    check_ok(procs["odc_replay"])
    replay = reports(out["odc_replay"], "result_replay")[0]
    assert _max_rel(_params(odc[0], "initial"), _params(replay, "initial")) == 0.0
    assert _max_rel(_params(odc[0]), _params(replay)) <= 1e-4


def test_unequal_microbatch_counts_in_the_last_step_match_one_process(runs):
    procs, out = runs["procs"], runs["out"]
    check_ok(procs["uneven"])
    ranks = reports(out["uneven"], "result_rank")
    # 7 batches of 2 samples: rank 0 gets 4, rank 1 gets 3; accelerate syncs rank 1's last step at its last batch.
    assert [[len(s) for s in r["steps"]] for r in ranks] == [[2, 2], [2, 1]]
    assert _max_change(ranks[0]) > 1e-3
    assert _max_rel(_params(ranks[0]), _params(ranks[1])) == 0.0
    check_ok(procs["uneven_replay"])
    replay = reports(out["uneven_replay"], "result_replay")[0]
    # A loss weighted per rank instead of per microbatch would move the weights by ~lr (5e-3): measured 1.7e-5.
    assert _max_rel(_params(ranks[0]), _params(replay)) <= 1e-4


def test_odc_off_is_one_fsdp2_job(runs):
    procs, out = runs["procs"], runs["out"]
    check_ok(procs["plain"])
    ranks = reports(out["plain"], "result_rank")
    assert [(r["world"], r["distributed_type"]) for r in ranks] == [(2, "DistributedType.FSDP")] * 2
    assert [r["plugin"] for r in ranks] == ["FullyShardedDataParallelPlugin"] * 2
    assert sum(r["local_numel"] for r in ranks) == ranks[0]["numel"]  # each rank holds its half of one model
    assert ranks[0]["steps"] != ranks[1]["steps"]  # each rank ran its own samples ...
    assert _max_rel(_params(ranks[0]), _params(ranks[1])) == 0.0  # ... into one model
    assert _max_change(ranks[0]) > 1e-3


def test_sync_each_batch_with_auto_is_refused_on_every_rank_before_training(runs):
    proc = runs["procs"]["refused"]
    assert proc.returncode != 0
    message = "ValueError: accelerate's sync_each_batch=True asks for a reduce after every microbatch, but "
    for rank in (0, 1):  # each rank raised it (neither was stopped by its peer's failure)
        assert f"[rank{rank}]: {message}odc_memory_policy=auto" in proc.stderr, proc.stderr[-4000:]
    assert not reports(runs["out"]["refused"], "result_rank")


def test_no_shared_memory_left(runs):
    assert shm_leftovers() <= runs["shm_before"]
