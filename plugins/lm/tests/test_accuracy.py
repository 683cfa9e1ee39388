"""``corelooper_lm.accuracy.argmax``: the CPU's two-level argmax gives ``torch.argmax``'s indices
(the first maximum), ties, NaN and vocabularies of any size included; ``entropy`` is TRL's
``entropy_from_logits``, a piece at a time. The training logs' ``token_accuracy`` and ``entropy``
themselves are checked against TRL in plugins/sft/tests/test_train_token_accuracy.py."""

from __future__ import annotations

import pytest
import torch
from corelooper_lm import accuracy
from corelooper_lm.accuracy import TrainTokenAccuracy, argmax, entropy
from corelooper_lm.metrics import TokenAccuracy


@pytest.mark.parametrize(
    "shape", [(450, 2048), (3, 5, 2048), (7, 50257), (4, 151936), (2, 300), (1, 0, 64), (5, 32000), (6, 17)]
)
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


def trl_entropy(logits: torch.Tensor) -> torch.Tensor:
    """TRL's ``entropy_from_logits`` (trl/trainer/utils.py, without triton), written out."""
    log_p = torch.log_softmax(logits.reshape(-1, logits.shape[-1]), dim=-1)
    return -(torch.exp(log_p) * log_p).sum(-1).reshape(logits.shape[:-1])


@pytest.mark.parametrize("shape", [(450, 2048), (3, 5, 300), (2, 151936), (1, 0, 64)])
def test_entropy_is_trls_in_pieces_too(shape, monkeypatch):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * 3
    whole = entropy(x)
    torch.testing.assert_close(whole.double(), trl_entropy(x.double()), rtol=0, atol=1e-6)  # the exact value
    torch.testing.assert_close(
        whole, trl_entropy(x), rtol=1e-5, atol=1e-5
    )  # TRL's float32 formula rounds more
    monkeypatch.setattr(accuracy, "ENTROPY_CHUNK", 7 * max(shape[-1], 1))  # pieces of 7 rows
    assert torch.equal(entropy(x), whole)  # each row alone: the pieces change nothing
    assert entropy(x.bfloat16()).dtype == torch.float32  # counted in float32, whatever the logits


def test_entropy_of_rows_with_ruled_out_tokens_and_nan():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    ruled_out = x.clone()
    ruled_out[:, 40:] = float("-inf")  # a vocabulary's padding, masked
    torch.testing.assert_close(entropy(ruled_out), trl_entropy(x[:, :40]), rtol=0, atol=1e-5)
    assert torch.isnan(trl_entropy(ruled_out)).all()  # TRL's formula: 0 * -inf
    x[2, 7] = float("nan")
    assert torch.isnan(entropy(x)).tolist() == [False, False, True, False]  # NaN logits are not hidden


def test_the_streaming_metric_counts_entropy_from_logits_or_its_preprocessing():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 9, 50, generator=g)
    labels = torch.randint(0, 50, (2, 9), generator=g)
    labels[0, :4] = -100
    counted = labels[:, 1:] != -100
    want = trl_entropy(logits[:, :-1])[counted].double().mean().item()
    raw, pre = TokenAccuracy(entropy=True), TokenAccuracy(entropy=True)
    raw.update(logits, labels)
    pre.update(pre.preprocess_logits(logits), labels)
    assert raw.compute() == pre.compute()
    assert raw.compute()["entropy"] == pytest.approx(want, abs=1e-6)
    hits = (logits[:, :-1].argmax(-1) == labels[:, 1:])[counted].double().mean().item()
    assert raw.compute()["accuracy"] == pytest.approx(hits, abs=1e-12)
    with pytest.raises(ValueError, match="needs the logits"):
        TokenAccuracy(entropy=True).update(logits.argmax(-1), labels)
    assert set(TokenAccuracy(entropy=True, accuracy=False).compute()) == {"entropy"}
