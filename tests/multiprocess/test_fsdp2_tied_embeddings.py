"""FSDP2 wrapping of a model whose LM head is its input embedding (``tie_word_embeddings``), as accelerate 1.14 does.

accelerate 1.14 (supported) shards the tail group ``[final norm, input embedding]`` and leaves the LM head to the
root: torch 2.13 refuses that, older torch trains the two as separate weights. The package's accelerate patch
(`odc_accelerate._compat.accelerate._tied_embeddings_in_one_group`) puts the LM head in the embedding's group. The
installed accelerate (1.15) groups them itself, which the SFT, DPO and GRPO runs on the tied model test end to end;
here accelerate 1.14's sequence of ``fully_shard`` calls is replayed on 2 ranks (`tests/helpers/workers/tied_workers.py`)
and compared with the same model in one process.
"""

import numpy as np

from odc_accelerate.testing import launch
from tests.helpers.workers.tied_workers import wrap_tied_model


def test_tied_head_shares_the_embeddings_group_and_trains_as_one_weight():
    ranks = launch(wrap_tied_model, 2, timeout=240)
    uncorrected, corrected = [r["uncorrected"] for r in ranks], [r["corrected"] for r in ranks]
    # positive control: the replayed sequence breaks the tie (torch >= 2.13 refuses it; older torch unties it)
    for r in uncorrected:
        if r["error"] is not None:
            assert "shared with a parameter already managed by another FSDP group" in r["error"], r["error"]
        else:
            assert not r["tied"]
            assert not np.allclose(r["grad"], r["expected_grad"], rtol=1e-4, atol=1e-7)
    for r in corrected:
        assert r["error"] is None, r["error"]
        assert r["tied"]  # one sharded parameter under both names
        assert abs(r["loss"] - r["expected_loss"]) <= 1e-6 * abs(r["expected_loss"])
        # the gradient of both uses (embedding and LM head) in one weight, as in one process
        np.testing.assert_allclose(r["grad"], r["expected_grad"], rtol=1e-5, atol=1e-8)
