"""Lanes: independent replicas of one mechanism side by side (``Context.lanes``), which the
empirical audit uses to run its trials in one pass through the training harness."""

from __future__ import annotations

import torch
from torch import nn

from dpbench.privacy.clipping import Clipping
from dpbench.mechanisms.noise import GaussianNoise
from dpbench.mechanisms.sampling import FixedBatchSampler
from dpbench.optimizers.base import SGD, Context
from dpbench.optimizers.dice import DiceStep


def test_fixed_batches_per_lane_partition_each_lane_and_lane0_is_the_single_sampler():
    n, L, lanes = 23, 4, 3
    single = FixedBatchSampler(n, L, seed=7)
    multi = FixedBatchSampler(n, L, seed=7, lanes=lanes)
    assert multi.batches.shape == (n // L, lanes * L)
    assert torch.equal(multi.batches[:, :L], single.batches)  # lane 0 draws what one sampler draws
    for lane in range(lanes):
        block = multi.batches[:, lane * L:(lane + 1) * L]
        assert ((block >= lane * n) & (block < (lane + 1) * n)).all()
        assert block.unique().numel() == block.numel()  # each example once per epoch
    # lanes are shuffled independently
    assert not torch.equal(multi.batches[:, L:2 * L] - n, multi.batches[:, :L])


def test_dice_clips_its_residual_per_lane():
    """clip(e, C2) uses each lane's own norm: a big residual in lane 0 must not shrink lane 1's."""
    lanes, d = 2, 3
    model = nn.Linear(d, lanes, bias=False)
    ctx = Context(model=model, loss_fn=None, lr=0.0, expected_batch_size=1, noise_multiplier=0.0,
                  clipping=Clipping(1.0), noise=GaussianNoise(0), steps=1, lanes=lanes)
    step = DiceStep(ctx, SGD(0.0), c2=1.0)
    step.residual = [torch.tensor([[30.0, 40.0, 0.0], [0.3, 0.4, 0.0]])]  # norms 50 and 0.5
    out = step.clip_and_sum(None)[0]  # no examples: the sum is L clip(e, C2)
    torch.testing.assert_close(out, torch.tensor([[0.6, 0.8, 0.0], [0.3, 0.4, 0.0]]))
