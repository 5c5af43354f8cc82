"""ODC vs FSDP2 vs single-process training, with real 2-rank gloo processes on CPU."""

import numpy as np
import pytest

from odc_accelerate._compat import torch as torch_compat
from odc_accelerate.testing import launch
from tests.helpers.workers.engine_workers import reference, train
from tests.helpers.workers.hf_parity_workers import hf_parity_runs
from tests.helpers.workers.hf_parity_workers import reference as hf_reference

# plan[step][rank] = sequence lengths, one sequence per microbatch (>1 microbatch = gradient accumulation)
EQUAL = [[[12, 8], [10, 9]], [[7, 11], [13, 5]], [[9, 9], [6, 14]]]
ONE_EACH = [[[12], [8]], [[7], [11]], [[9], [6]]]  # one microbatch per rank and step


def rel_diff(a: dict, b: dict) -> float:
    num = sum(float(((a[k].astype(np.float64) - b[k]) ** 2).sum()) for k in b)
    den = sum(float((b[k].astype(np.float64) ** 2).sum()) for k in b)
    return (num / den) ** 0.5


def run(mode: str, **spec):
    return launch(train, 2, dict(spec, mode=mode), timeout=240)


def assert_no_comm_during_microbatches(results):
    for rank, res in enumerate(results):
        for step, counts in enumerate(res["counts"]):
            assert counts == {}, f"rank {rank} step {step} made torch.distributed calls during microbatches: {counts}"


def test_fp32_matches_fsdp2_with_clipping_and_accumulation():
    spec = dict(plan=EQUAL, clip=0.5)
    fsdp, odc = run("fsdp", **spec), run("odc", **spec)
    # positive control: the counter sees FSDP2's per-layer collectives
    assert all(sum(c.values()) > 0 for c in fsdp[0]["counts"])
    assert_no_comm_during_microbatches(odc)
    # clipping was active and saw the same global norms
    assert max(odc[0]["norms"]) > 0.5
    np.testing.assert_allclose(odc[0]["norms"], fsdp[0]["norms"], rtol=1e-6)
    assert rel_diff(odc[0]["params"], fsdp[0]["params"]) <= 1e-6
    # every rank ends with the same full model
    assert rel_diff(odc[1]["params"], odc[0]["params"]) == 0.0


def test_bf16_mixed_precision_bit_identical_to_fsdp2():
    spec = dict(plan=EQUAL, clip=0.5, precision="bf16")
    fsdp, odc = run("fsdp", **spec), run("odc", **spec)
    assert_no_comm_during_microbatches(odc)
    for name, ref in fsdp[0]["params"].items():
        np.testing.assert_array_equal(odc[0]["params"][name], ref, err_msg=name)


def test_bf16_compute_with_fsdp2s_default_reduce_dtype_bit_identical_to_fsdp2():
    # MixedPrecisionPolicy(param_dtype=bf16) without a reduce_dtype: FSDP2 reduces in bf16 before torch 2.15 and in
    # the params' fp32 from 2.15 on. The engine must pick the same dtype, or the runs would differ. One microbatch per
    # rank and step: with several, a bf16 reduce rounds differently in the engine's bf16 accumulator than in FSDP2's
    # per-microbatch reduce-scatters added into the fp32 .grad.
    spec = dict(plan=ONE_EACH, clip=0.5, precision="bf16-compute")
    fsdp, odc = run("fsdp", **spec), run("odc", **spec)
    expected = "torch.float32" if torch_compat.has("grad_dtypes") else "torch.bfloat16"
    assert set(odc[0]["reduce_dtypes"]) == {expected}, (odc[0]["reduce_dtypes"], torch_compat.TORCH_VERSION)
    for name, ref in fsdp[0]["params"].items():
        np.testing.assert_array_equal(odc[0]["params"][name], ref, err_msg=name)


def test_per_param_grad_dtypes_bit_identical_to_fsdp2():
    # bf16 gradients for a few fp32 params: from torch 2.15 on, FSDP2 packs each group's reduce-scatter by gradient
    # dtype (these params last), reduces in fp32 and casts their slices back to bf16; the engine's accumulator layout
    # and fold must follow. Earlier releases drop the setting: every gradient is fp32 and the order is the group's.
    # One microbatch per rank and step, so that both sum the same two fp32 gradients (bit-identical before the
    # bf16 cast); zero_grad every other step, so that the second step adds into the bf16 .grad of the first.
    narrow = ["blocks.0.qkv.weight", "blocks.0.up.weight", "blocks.2.norm1.bias"]
    spec = dict(plan=ONE_EACH, record_grads=True, zero_grad_every=2, grad_dtypes=dict.fromkeys(narrow, "bfloat16"))
    fsdp, odc = run("fsdp", **spec), run("odc", **spec)
    honoured = torch_compat.has("grad_dtypes")
    for step, dtypes in enumerate(odc[0]["grad_dtypes"]):
        assert dtypes == fsdp[0]["grad_dtypes"][step]
        assert {n for n, d in dtypes.items() if d == "torch.bfloat16"} == (set(narrow) if honoured else set()), dtypes
    for step, ref_grads in enumerate(fsdp[0]["grads"]):
        for name, ref in ref_grads.items():
            np.testing.assert_array_equal(odc[0]["grads"][step][name], ref, err_msg=f"step {step} {name}")
    for name, ref in fsdp[0]["params"].items():
        np.testing.assert_array_equal(odc[0]["params"][name], ref, err_msg=name)


def test_shard_dim1_divide_factor_no_sync_and_grad_carry_over_match_fsdp2():
    # Shard(1) placements for 2-D weights, a gradient divide factor that is not the world size,
    # accelerate-style no_sync on all but the last microbatch, and .grad carried into the next
    # step (zero_grad every other step), where both must add into the existing .grad.
    spec = dict(plan=EQUAL, clip=0.5, shard_dim1=True, grad_divide_factor=3.0, no_sync=True, zero_grad_every=2)
    fsdp, odc = run("fsdp", **spec), run("odc", **spec)
    assert rel_diff(odc[0]["params"], fsdp[0]["params"]) <= 1e-6


def test_param_groups_on_two_process_groups_over_the_same_ranks_train_like_one_process():
    # The blocks' fully_shard calls on one gloo group, the root's on another over the same ranks: ODC replaces
    # FSDP2's collectives, so only the ranks and their order matter. Unequal work, against one process.
    plan = [[[12], [10, 9, 8]], [[7, 11], [13]]]
    ref = reference(dict(plan=plan, clip=0.5))
    odc = run("odc", plan=plan, clip=0.5, two_groups=True)
    assert_no_comm_during_microbatches(odc)
    assert rel_diff(odc[0]["params"], ref) <= 1e-5
    assert rel_diff(odc[1]["params"], odc[0]["params"]) == 0.0


def regroup_evenly(plan):
    """The same sequences, in the same order, split 50/50 between the two ranks (equal work for FSDP2)."""
    out = []
    for step in plan:
        flat = [length for rank_plan in step for length in rank_plan]
        out.append([flat[: len(flat) // 2], flat[len(flat) // 2 :]])
    return out


@pytest.mark.parametrize(
    "unequal",
    [
        [[[12], [10, 9, 8]], [[7], [11, 13, 5]], [[9], [9, 6, 14]]],  # 1 vs 3 microbatches
        [[[], [12, 8]], [[7, 11], []], [[], [9, 9]]],  # 0 vs 2, alternating which rank idles
    ],
    ids=["1v3", "0v2"],
)
def test_unequal_microbatch_counts_match_single_process(unequal):
    equal = regroup_evenly(unequal)
    ref = reference(dict(plan=unequal, clip=0.5))
    assert rel_diff(reference(dict(plan=equal, clip=0.5)), ref) == 0.0  # same global batches
    odc = run("odc", plan=unequal, clip=0.5)
    fsdp_equal = run("fsdp", plan=equal, clip=0.5)
    assert_no_comm_during_microbatches(odc)
    odc_err = rel_diff(odc[0]["params"], ref)
    fsdp_err = rel_diff(fsdp_equal[0]["params"], ref)
    assert odc_err <= 1e-5, odc_err
    # ODC with unequal work is as close to the truth as FSDP2 with equal work (both are rounding noise;
    # the factor covers the noise of different summation orders).
    assert odc_err <= 3 * fsdp_err + 1e-7, (odc_err, fsdp_err)


def test_step_where_no_rank_runs_a_microbatch_leaves_parameters_alone():
    plan = [[[12], [8]], [[], []], [[9], [9]]]
    odc = run("odc", plan=plan, record_grads=True)
    grads = odc[0]["grads"]
    assert all(g is not None for g in grads[0].values())
    assert all(g is None for g in grads[1].values()), "no rank ran: no gradient, AdamW skips the step"
    ref = reference(dict(plan=plan))
    assert rel_diff(odc[0]["params"], ref) <= 1e-5


def test_zero_microbatch_rank_receives_gradients_of_its_shards():
    # rank 0 runs nothing: its .grad must still be the full step gradient (from rank 1's pushes)
    plan = [[[], [12, 8]]]
    odc = run("odc", plan=plan, record_grads=True)
    fsdp_equal = run("fsdp", plan=[[[12], [8]]], record_grads=True)
    for name, g in fsdp_equal[0]["grads"][0].items():
        np.testing.assert_allclose(odc[0]["grads"][0][name], g, rtol=1e-5, atol=1e-7, err_msg=name)


def max_rel(a: dict, b: dict) -> float:
    """The largest ``max |a - b| / max |b|`` over the tensors of ``b``."""
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max() / (np.abs(b[k]).max() + 1e-30)) for k in b)


# sequence lengths per rank and step: 2 vs 1 microbatches, then 1 vs 2, then a rank with none
HF_PLAN = [[[15, 15], [15]], [[15], [15, 15]], [[], [15, 15, 15]]]


def test_hf_llama_and_moe_with_unequal_microbatches_match_one_process_running_the_same_microbatches():
    cases = [dict(model=m, reduction=r) for m in ("llama", "moe") for r in ("ordered", "atomic")]
    runs = launch(hf_parity_runs, 2, dict(plan=HF_PLAN, cases=cases), timeout=300)
    for model in ("llama", "moe"):
        split = hf_reference(model, HF_PLAN, "split")
        ordered, atomic = runs[0][f"{model}/ordered"], runs[0][f"{model}/atomic"]
        # ordered: each owner adds the same operands in the same order as the one process: not a bit may differ
        for step, ref in enumerate(split["grads"]):
            for name, g in ref.items():
                np.testing.assert_array_equal(ordered["grads"][step][name], g, err_msg=f"{model} step {step} {name}")
        for name, p in split["params"].items():
            np.testing.assert_array_equal(ordered["params"][name], p, err_msg=f"{model} {name}")
        # atomic: peers add in arrival order, so rounding only (measured: step-1 gradients 1.1e-7 / 9.6e-8 max
        # relative, parameters 5.2e-8 / 6.3e-8; a 4e-6 relative error in the adds fails the first check)
        assert max_rel(atomic["grads"][0], split["grads"][0]) <= 1e-6, model
        assert rel_diff(atomic["params"], split["params"]) <= 1e-6, model
        assert all(rel_diff(runs[1][k]["params"], runs[0][k]["params"]) == 0.0 for k in runs[0])
        # The step's microbatches as one batch: the same numbers to fp32 rounding (step-1 gradients 3.3e-7 / 4.5e-7
        # max relative), which AdamW turns into parameter noise in near-zero gradient entries (6.0e-6 / 4.9e-6 max
        # relative, 1.2e-7 / 8.2e-8 relative norm, after 3 steps): a property of the split, not of the engine, and
        # the same with transformers 5.23 and 5.24 (docs/versions.md).
        concatenated = hf_reference(model, HF_PLAN, "concatenated")
        assert max_rel(split["grads"][0], concatenated["grads"][0]) <= 1e-6, model
        assert rel_diff(ordered["params"], concatenated["params"]) <= 1e-6, model
