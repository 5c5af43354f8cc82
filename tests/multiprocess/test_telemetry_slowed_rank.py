"""Busy and wait mean the same for ODC and plain FSDP2: a rank made slower by a known amount shows in its peer's wait.

Each run is the SFT example under a real 2-rank `accelerate launch`. Rank 1 sleeps ``SLOW_S`` in the loss of the first
microbatch of every even-numbered optimizer step (``ODC_SLOW_RANK`` / ``ODC_SLOW_S`` of ``run_example.py``). Busy is
each rank's own forward and backward, wait the rest of the step, so on the slowed steps
rank 0's wait grows by the sleep (it waits for rank 1 at the step boundary under ODC, in the next collective under
FSDP2), within 30%. Rank 1's own figures are printed, not asserted: on a shared CPU its compute runs faster while rank
0 idles, so its busy grows by less than the sleep.

The reference is the same run's odd-numbered steps (same model, same plan, no sleep); step 1 (warm-up) is left out.
"""

from __future__ import annotations

import statistics

import pytest
from integration_utils import CONFIGS, TRAIN, accelerate_launch, check_ok, logged_steps

SLOW_S = 2.5
STEPS = 5
ARGS = [
    "--odc_metrics",
    "per_rank",
    "--max_steps",
    str(STEPS),
    "--logging_steps",
    "1",
    "--report_to",
    "none",
    "--save_strategy",
    "no",
    "--max_length",
    "64",
    "--per_device_train_batch_size",
    "2",
    "--gradient_accumulation_steps",
    "2",
    "--seed",
    "0",
    "--dataloader_pin_memory",
    "false",
]


@pytest.mark.parametrize(
    ("config", "extra"),
    [
        pytest.param("odc_cpu.yaml", ["--odc", "true"], id="odc"),
        # FSDP2's waits happen inside its per-layer collectives: they are seen when the collectives are timed.
        pytest.param("fsdp2_cpu.yaml", ["--odc_time_collectives", "true"], id="fsdp2"),
    ],
)
def test_slowed_rank_shows_in_the_other_ranks_wait(tmp_path, config, extra):
    out = tmp_path / "out"
    proc = accelerate_launch(
        CONFIGS / config, TRAIN, *ARGS, *extra, "--output_dir", str(out), ODC_SLOW_RANK="1", ODC_SLOW_S=str(SLOW_S)
    )
    check_ok(proc)
    steps = logged_steps(out)
    assert [int(s["step"]) for s in steps] == list(range(1, STEPS + 1))
    slowed = [s for s in steps[1:] if int(s["step"]) % 2 == 0]
    plain = [s for s in steps[1:] if int(s["step"]) % 2 == 1]

    def mean(rows: list[dict], key: str) -> float:
        return statistics.fmean(float(r[key]) for r in rows)

    wait0 = mean(slowed, "odc/wait_s_rank0") - mean(plain, "odc/wait_s_rank0")
    busy1 = mean(slowed, "odc/busy_s_rank1") - mean(plain, "odc/busy_s_rank1")
    wait1 = mean(slowed, "odc/wait_s_rank1") - mean(plain, "odc/wait_s_rank1")
    figures = (
        f"rank 0 wait +{wait0:.3f} s, rank 1 busy +{busy1:.3f} s, rank 1 wait {wait1:+.3f} s for a {SLOW_S} s sleep"
    )
    print(f"{config}: {figures}")
    assert abs(wait0 - SLOW_S) <= 0.3 * SLOW_S, figures
