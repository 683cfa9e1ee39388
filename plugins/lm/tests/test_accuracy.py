"""``corelooper_lm.accuracy.argmax``: the CPU's two-level argmax gives ``torch.argmax``'s indices
(the first maximum), ties, NaN and vocabularies of any size included. The training logs'
``token_accuracy`` itself is checked against TRL in plugins/sft/tests/test_train_token_accuracy.py."""

from __future__ import annotations

import pytest
import torch
from corelooper_lm.accuracy import TrainTokenAccuracy, argmax


@pytest.mark.parametrize("shape", [(450, 2048), (3, 5, 2048), (7, 50257), (4, 151936), (2, 300), (1, 0, 64),
                                   (5, 32000), (6, 17)])
def test_the_same_indices_as_torch_argmax(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    assert torch.equal(argmax(x), x.argmax(-1))


def test_ties_take_the_first_maximum_as_argmax_does():
    ties = torch.randn(200, 4096, generator=torch.Generator().manual_seed(1)).mul(2).round().bfloat16()
    assert (ties == ties.amax(-1, keepdim=True)).sum(-1).gt(1).any()  # rows with tied maxima
    assert torch.equal(argmax(ties), ties.argmax(-1))
    flat = torch.zeros(3, 1024)
    assert argmax(flat).tolist() == [0, 0, 0]
    nan = torch.randn(3, 1024)
    nan[1, 700] = nan[1, 900] = float("nan")
    assert torch.equal(argmax(nan), nan.argmax(-1))


def test_counts_hits_over_counted_targets_only():
    logits = torch.tensor([[[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]]])
    targets = torch.tensor([[1, 2, 2, -100]])  # hit, miss, hit, not counted
    counter = TrainTokenAccuracy()
    counter.add(logits, targets)
    counter.add(logits[:, :1], targets[:, :1])
    assert counter.local.tolist() == [3, 4]
