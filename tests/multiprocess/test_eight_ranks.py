"""Eight ranks on the ``shm`` transport: the GPU procedure's eight-rank case (`check_parity.case_ranks8`) on the CPU
transport, beside the dry run's, which runs it on the 'cuda' transport's protocol (`test_gpu_session_on_cpu.py`).

* the toy LM with 0 to 3 microbatches per rank (two ranks with none in every step) against one process summing the
  same microbatches: gradients and parameters after 3 AdamW steps;
* the same steps under the ``dynamic`` plan: every microbatch claimed by exactly one rank, the same parameters;
* the claim counter with 8 ranks claiming at once (every index exactly once), ranks that start after the queue is
  drained (none), an empty round;
* 7 ranks adding into one owner's accumulators at once, fp32 and bf16 sources of small integers: the owner's sums equal
  the exact one, nobody else's accumulator changed.
"""

from __future__ import annotations

from tests.gpu.check_parity import PLAN8, RANKS8, case_ranks8


def test_eight_ranks_on_shm_match_one_process_claim_exactly_once_and_add_exactly():
    result = case_ranks8("cpu", transports=["shm"])
    assert all(result["checks"].values()), result["checks"]
    res = result["shm"]
    # one process summing the same microbatches (fp32): gradients to summation order, parameters after 3 AdamW steps
    assert res["grad"]["rel"] < 1e-5 and res["params_after_3_steps"]["max_abs"] < 1e-4
    assert res["dynamic_params_after_3_steps"]["max_abs"] < 1e-4
    # the static plan as run: 0 to 3 microbatches per rank; the dynamic one: each step's queue split over the 8 ranks
    assert result["plan_microbatches_per_rank"] == [[len(mbs) for mbs in step] for step in PLAN8]
    assert [sum(step) for step in res["dynamic_claimed_per_rank"]] == [sum(map(len, step)) for step in PLAN8]
    assert all(len(step) == RANKS8 for step in res["dynamic_claimed_per_rank"])
    # the counter raced by 8 ranks: each took part, 800 indices in all; the drained queue leaves the others none
    for race in ("race", "again"):
        counts = res["claims_per_rank"][race]
        assert len(counts) == RANKS8 and min(counts) > 0 and sum(counts) == 800, counts
    assert res["claims_per_rank"]["none"] == [6] + [0] * (RANKS8 - 1)
    assert res["counter"] == "ShmTransport"
    # the owner's accumulators: the exact sum of 7 senders x 3 adds (the shm transport accumulates in the buffer's
    # own dtype: small integers are exact in bf16 too)
    for source in ("fp32", "bf16"):
        added = res["accumulate_into_one"][source]
        assert added["exact"] and added["max_abs_err"] == 0.0, added
        assert added["accumulator_dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[source]
