"""The GPU procedure is tested code: its one command's CPU dry run, ``bash scripts/gpu_session.sh OUT --device cpu``,
runs every case that exists on CPU and leaves what a GPU machine sends back: at most 8 files (an archive, the speed
case's JSON and the summary), the table printed last. The cases, each checked here against what it must show:

* ``check:parity``: the engine's parity through ``gpu_check`` (the ``shm`` transport and the ``cuda`` transport's
  protocol over shared memory);
* ``check:ranks8``: 8 ranks: parity with 0 to 3 microbatches per rank, the dynamic plan's claims (each microbatch
  exactly once), the claim counter raced by 8 ranks, 7 ranks adding into one owner's accumulators at once, exact;
* ``check:ordered``: the ordered gradient reduction's step time against atomic's (figures stored, never asserted),
  the two equal to rounding, two ordered runs with deterministic algorithms ending bitwise equal;
* ``trainer:sft_fp32``: the SFT example under ``accelerate launch`` with 2 ranks, 8 ranks, and 8 ranks under the
  dynamic plan with one rank claiming none, each against TRL's trainer in one process (per-step loss, the update of
  every tensor);
* ``trainer:grpo``; ``trainer:speed``: the speed arms end to end on a tiny model (figures stored, never asserted).

The jobs' Python processes start as forks of the session's warm-start server (`tests/helpers/infra/warm_start.py`), as the
integration tests' do.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

from integration_utils import plain_env

from tests.helpers.infra import warm_start

ROOT = Path(__file__).resolve().parents[2]


def _session(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = ["bash", str(ROOT / "scripts" / "gpu_session.sh"), str(out), *args]
    env = warm_start.env(plain_env(PYTHON=sys.executable))
    return subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL
    )


def test_gpu_session_dry_run_on_cpu_runs_every_cpu_case_and_returns_three_files(tmp_path):
    out = tmp_path / "out"
    proc = _session(out, "--device", "cpu")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["session.tar.gz", "summary.txt", "trainer_speed.json"]
    summary = (out / "summary.txt").read_text()
    # The table is what the command prints last, and its form: a header, then one row per case, all passed.
    assert proc.stdout.endswith(summary)
    lines = summary.splitlines()
    assert lines[0].startswith("GPU session (cpu), ") and lines[1].split() == ["case", "status", "checks", "s"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert list(rows) == [
        "check:parity",
        "check:ranks8",
        "check:ordered",
        "trainer:sft_fp32",
        "trainer:grpo",
        "trainer:speed",
    ]
    for row in rows.values():
        passed, total = map(int, row[2].split("/"))
        assert row[1] == "pass" and passed == total > 0, row
    with tarfile.open(out / "session.tar.gz") as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "unpacked", filter="data")
    assert "session/env.txt" in names and "session/summary.txt" in names
    unpacked = tmp_path / "unpacked" / "session"
    assert any(line.startswith("commit ") for line in (unpacked / "env.txt").read_text().splitlines())

    parity = json.loads((unpacked / "check_parity" / "results.json").read_text())
    assert set(parity) == {"environment", "parity"}
    checks = parity["parity"]["checks"]
    # both transports, fp32 and the bf16 variants, each compared against one process
    assert len(checks) == 7 and all(checks.values()), checks
    assert any("cuda-on-cpu" in name for name in checks) and any("shm" in name for name in checks)
    # fp32 accumulators take the accumulate kernel (Triton's interpreter on CPU tensors); bf16 ones the index_add_
    # fallback (the interpreter has no bf16 atomics)
    paths = {run: res["accumulate_path"] for run, res in parity["parity"].items() if "cuda-on-cpu" in run}
    assert paths == {
        "fp32/cuda-on-cpu": "kernel",
        "bf16-fp32-reduce/cuda-on-cpu": "kernel",
        "bf16/cuda-on-cpu": "kernel",
        "bf16/cuda-on-cpu-bf16-acc": "index_add_",
    }, paths

    ranks8 = json.loads((unpacked / "check_ranks8" / "results.json").read_text())["ranks8"]
    assert len(ranks8["checks"]) == 9 and all(ranks8["checks"].values()), ranks8["checks"]
    res = ranks8["cuda-on-cpu"]
    # the plan as run: 0 to 3 microbatches per rank, two ranks with none in every step
    assert all(min(step) == 0 and max(step) == 3 for step in ranks8["plan_microbatches_per_rank"])
    assert res["grad"]["rel"] < 1e-5 and res["dynamic_params_after_3_steps"]["max_abs"] < 1e-4
    # the dynamic plan's claims: every rank's count per step adds up to the step's queue
    queues = [sum(step) for step in ranks8["plan_microbatches_per_rank"]]
    assert [sum(step) for step in res["dynamic_claimed_per_rank"]] == queues == [11, 10, 9]
    assert res["claims_per_rank"]["none"] == [6, 0, 0, 0, 0, 0, 0, 0]
    assert all(c > 0 for c in res["claims_per_rank"]["race"]) and sum(res["claims_per_rank"]["race"]) == 800
    for source in ("fp32", "bf16"):
        assert res["accumulate_into_one"][source]["exact"], res["accumulate_into_one"]

    ordered = json.loads((unpacked / "check_ordered" / "results.json").read_text())["ordered"]
    assert len(ordered["checks"]) == 5 and all(ordered["checks"].values()), ordered["checks"]
    assert ordered["transport"] == "cuda-on-cpu" and ordered["deterministic_runs"] == [True, True]
    assert ordered["plan_microbatches_per_rank"] == [1, 3] and ordered["steps_timed"] == 2
    # the medians of the same steps for both reductions; the ordered exchange timed inside the ordered step
    assert set(ordered["step_s_median"]) == {"atomic", "ordered"}
    assert 0 < ordered["exchange_s_median"] < ordered["step_s_median"]["ordered"]
    first, second = ordered["hashes"]
    assert first == second and len(first) == 2 and len(first[0]) > 5  # per rank, every parameter
    assert "ordered / atomic" in (unpacked / "check_ordered" / "summary.txt").read_text()

    trainer = json.loads((unpacked / "trainer_sft_fp32" / "results.json").read_text())
    sft = trainer["sft_fp32"]
    # ODC on 2 ranks with unequal microbatches against TRL's trainer in one process, through the shared-GPU switch
    # the weight updates, relative to the update's norm, from the same start, every tensor moved
    assert sft["loss_max_rel"] <= 1e-4 and sft["update_rel"] <= 1e-4
    assert sft["same_start"] and sft["unmoved"] == []
    assert sft["transports"] == ["ShmTransport"] * 2
    assert sft["microbatches_min_max_per_step"] == [[5, 6], [5, 6]]  # 11 samples per step, one per microbatch
    # peak memory logged per step (on CPU the resident set; on a GPU torch's allocator peak)
    assert len(sft["peak_mem_mb_per_step"]) == 2 and all(m > 0 for m in sft["peak_mem_mb_per_step"])
    for key, counts in (("sft_fp32_8ranks", [[1, 2], [1, 2]]), ("sft_fp32_8ranks_dynamic", None)):
        run = trainer[key]
        assert all(run["checks"].values()), (key, run["checks"])
        assert run["ranks"] == 8 and run["transports"] == ["ShmTransport"] * 8
        assert run["loss_max_rel"] <= 1e-4 and run["update_rel"] <= 1e-4 and run["unmoved"] == []
        if counts:
            assert run["microbatches_min_max_per_step"] == counts
    dynamic = trainer["sft_fp32_8ranks_dynamic"]
    # 11 microbatches claimed by 7 ranks, the eighth (late by construction) none
    assert [sum(step) for step in dynamic["claimed_per_rank"]] == [11, 11]
    assert all(step[-1] == 0 and min(step[:-1]) >= 1 for step in dynamic["claimed_per_rank"])

    grpo = json.loads((unpacked / "trainer_grpo" / "results.json").read_text())["grpo"]
    assert all(grpo["checks"].values()) and len(grpo["loss"]) == 3

    speed = json.loads((out / "trainer_speed.json").read_text())
    assert {"date", "commit", "versions", "platform"} <= set(speed["machine"])
    assert speed["model"]["num_hidden_layers"] == 2 and speed["model"]["tie_word_embeddings"]
    assert set(speed["runs"]) == {"odc2", "limit2", "odc1", "limit1"}
    for arm, runs in speed["runs"].items():
        assert len(runs) == 1 and runs[0]["ok"], (arm, runs)
        # the limit's processes each ran the whole global step: as many processes as the arm's ranks
        assert len(runs[0]["processes"]) == (1 if arm.startswith("odc") else int(arm[-1]))
        for process in runs[0]["processes"]:
            # warm-up, measured, and the profiled step (not measured), which wrote its top ops
            assert len(process["steps"]) == 3 and process["summary"]["steps_measured"] == 1
            assert process["profile"]["top"] and process["profile"]["step"] == 3
    assert set(speed["median_step_s"]) == {"odc2", "limit2", "odc1", "limit1"}
    assert set(speed["ratios"]) == {"odc2_over_limit2", "odc1_over_limit1"}
    # where ODC is more than 5% over its reference, the top ops of both (CPU timings of a tiny model vary)
    over = {ratio.split("_over_")[0] for ratio, value in speed["ratios"].items() if value > 1.05}
    assert {arm for arm in speed["profiles"] if arm.startswith("odc")} == over


def test_gpu_session_refuses_an_unknown_case_before_any_work(tmp_path):
    out = tmp_path / "out"
    for cases, unknown in (("check:parity,chek:memory", "chek:memory"), ("check:memroy", "check:memroy")):
        proc = _session(out, "--cases", cases)
        assert proc.returncode == 2 and f"unknown case '{unknown}'" in proc.stderr, proc.stderr
        assert not out.exists()
