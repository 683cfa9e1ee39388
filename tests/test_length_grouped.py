"""corelooper's length-grouped order is transformers' LengthGroupedSampler order (issue 28)."""

from __future__ import annotations

import pytest
import torch
from transformers.trainer_pt_utils import LengthGroupedSampler

from corelooper.data.loader import length_grouped_order


@pytest.mark.parametrize("n, batch", [(7, 4), (96, 8), (1000, 4), (5000, 8)])  # mult 1, 3, 50, 50
def test_the_order_of_hf_length_grouped_sampler(n, batch):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 300, (n,), generator=g).tolist()
    lengths[:5] = [17] * 5  # ties keep the permutation's order in both
    for seed, epoch in ((3, 0), (3, 1), (11, 2)):
        hf = LengthGroupedSampler(
            batch, lengths=lengths, generator=torch.Generator().manual_seed(seed + epoch)
        )
        assert length_grouped_order(lengths, batch, seed, epoch) == list(hf)


def test_mega_batches_are_min_of_a_quarter_and_50_batches():
    # 96 samples, batch 8: HF's mega-batch is min(96 // 32, 50) = 3 batches = 24 samples, sorted inside
    lengths = list(range(96))
    order = length_grouped_order(lengths, 8, seed=0, epoch=0)
    for m in range(4):
        block = order[m * 24 : (m + 1) * 24]
        rest = block[1:]  # a block's head may be the one swapped with the longest sample's
        assert rest == sorted(rest, key=lambda i: -lengths[i])
    assert order[0] == 95
    assert order != sorted(lengths, reverse=True)  # four mega-batches, not one (corelooper's old 50 always)
    # an explicit multiplier still works (50 batches: one mega-batch here, the whole set sorted)
    assert length_grouped_order(lengths, 8, seed=0, epoch=0, mega_batch_mult=50) == sorted(
        lengths, reverse=True
    )
