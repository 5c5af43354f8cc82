"""`loss_scale`: per-token losses scaled so that the rank average equals the global token mean."""

import pytest
import torch

from odc_accelerate.loss import loss_scale


def test_loss_scale():
    assert loss_scale(400, 4) == pytest.approx(0.01)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="global_num_tokens"):
            loss_scale(bad, 2)
    with pytest.raises(ValueError, match="world_size"):
        loss_scale(10, 0)


def test_loss_scale_makes_rank_average_equal_the_global_token_mean():
    # Independent check of the algebra: FSDP's mean over ranks of per-rank scaled sums == mean over tokens.
    gen = torch.Generator().manual_seed(0)
    token_losses = [torch.rand(n, generator=gen) for n in (3, 17, 40)]  # three ranks, unequal tokens
    world, total = len(token_losses), sum(t.numel() for t in token_losses)
    rank_avg = sum(t.sum() * loss_scale(total, world) for t in token_losses) / world
    torch.testing.assert_close(rank_avg, torch.cat(token_losses).mean())
