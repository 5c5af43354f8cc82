"""Params that get no gradient in some backwards: the reduce-scatter layout on every supported torch.

torch 2.12+ reduce-scatters every trainable param of a group (``set_reduce_scatter_unused_params``); torch 2.11 only
those that got a gradient, so there the engine places each param's rows at its own offset of the accumulator
(`odc_accelerate._compat.torch.layout.reduce_scatter_spans`). Both must train exactly like one process on the whole batch.
"""

import numpy as np

from odc_accelerate._compat import torch as torch_compat
from odc_accelerate.testing import launch
from tests.helpers.workers.engine_workers import reference, train

# plan[step][rank] = sequence lengths; a block's `gate` runs for odd lengths only. Every step has a backward with and
# one without the gate (on one rank or across ranks), and one rank idles in the last step.
PLAN = [[[12, 9], [7]], [[8], [11, 6]], [[], [10, 13]]]
SPEC = dict(plan=PLAN, clip=0.5, cfg=dict(gated=True, layers=2))


def rel_diff(a: dict, b: dict) -> float:
    num = sum(float(((a[k].astype(np.float64) - b[k]) ** 2).sum()) for k in b)
    den = sum(float((b[k].astype(np.float64) ** 2).sum()) for k in b)
    return (num / den) ** 0.5


def test_params_without_gradient_in_some_backwards_train_like_one_process():
    # Which path this torch takes (torch 2.11: the spans path).
    print(
        f"torch {torch_compat.TORCH_VERSION}: reduce_scatter_unused_params={torch_compat.has('reduce_scatter_unused_params')}"
    )
    ref = reference(SPEC)
    initial = reference(dict(SPEC, plan=[[[], []]]))  # no step runs: the initial weights
    gate = [k for k in ref if ".gate." in k]
    assert gate and all(not np.array_equal(ref[k], initial[k]) for k in gate)  # positive control: the gates train
    odc = launch(train, 2, dict(SPEC, mode="odc"), timeout=240)
    err = rel_diff(odc[0]["params"], ref)
    assert err <= 1e-5, err
    for k in gate:  # each gate alone too: a misplaced segment would show here first
        assert rel_diff({k: odc[0]["params"][k]}, {k: ref[k]}) <= 1e-5, k
    assert rel_diff(odc[1]["params"], odc[0]["params"]) == 0.0
