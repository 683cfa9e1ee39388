"""Tiny models whose out-of-memory errors are FAKED, for the auto batch size tests.

There is no GPU in CI, so a real CUDA OOM cannot happen: these models raise
``torch.OutOfMemoryError`` themselves when a forward pass gets more rows than their current
limit (``train_limit`` in train mode, ``eval_limit`` in eval mode). Everything else — the loop,
the retry, the gradients, accumulation, DDP — is real.
"""

from __future__ import annotations

import torch
from torch import nn

OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


class _FailInBackward(torch.autograd.Function):
    """Identity forward; the backward raises the fake OOM (after later layers got gradients)."""

    @staticmethod
    def forward(ctx, h, rows, limit):
        ctx.rows, ctx.limit = rows, limit
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        raise OOM(f"CUDA out of memory (FAKE, injected in backward: {ctx.rows} rows > {ctx.limit})")


class LimitedModel(nn.Module):
    """Base: counts forward sizes and raises the fake OOM above the limit."""

    def __init__(self, train_limit=None, eval_limit=None, in_backward: bool = False):
        super().__init__()
        self.train_limit, self.eval_limit, self.in_backward = train_limit, eval_limit, in_backward
        self.sizes: list[tuple[bool, int]] = []  # (training, rows) of every forward call
        self.ooms = 0

    def _too_big(self, rows: int) -> bool:
        self.sizes.append((self.training, rows))
        limit = self.train_limit if self.training else self.eval_limit
        too_big = limit is not None and rows > limit
        if too_big and not (self.in_backward and self.training):
            self.ooms += 1
            raise OOM(f"CUDA out of memory (FAKE, injected: {rows} rows > limit {limit})")
        return too_big

    def _maybe_fail_later(self, h, too_big: bool):
        if not too_big:
            return h
        self.ooms += 1
        return _FailInBackward.apply(h, h.shape[0], self.train_limit)

    def train_sizes(self) -> list[int]:
        return [n for training, n in self.sizes if training]


class LimitedMLP(LimitedModel):
    """8 features -> 4 classes."""

    def __init__(self, hidden: int = 16, dropout: float = 0.0, **limits):
        super().__init__(**limits)
        self.inp = nn.Linear(8, hidden)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(hidden, 4)

    def forward(self, x):
        too_big = self._too_big(x.shape[0])
        h = self._maybe_fail_later(torch.tanh(self.inp(x)), too_big)
        return self.out(self.drop(h))


class LimitedLM(LimitedModel):
    """A causal toy LM over 32 tokens (logits only; the loop computes the loss)."""

    def __init__(self, vocab: int = 32, dim: int = 8, **limits):
        super().__init__(**limits)
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask=None):
        self._too_big(input_ids.shape[0])
        h = self.embed(input_ids).cumsum(1) / torch.arange(1, input_ids.shape[1] + 1)[None, :, None]
        return self.head(h)


def mlp(seed: int = 0, **kw) -> LimitedMLP:
    torch.manual_seed(seed)
    return LimitedMLP(**kw)


def blobs(n: int = 64, seed: int = 0) -> list[dict]:
    """A learnable 4-class set: {"x": float[8], "labels": int}."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 8, generator=torch.Generator().manual_seed(123)) * 2
    y = torch.randint(0, 4, (n,), generator=g)
    x = centers[y] + torch.randn(n, 8, generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def tokens(n: int = 64, seq_len: int = 12, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (n, seq_len), generator=g)
    return [{"input_ids": ids[i], "labels": ids[i].clone()} for i in range(n)]
