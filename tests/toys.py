"""Tiny models and data sets for the core tests (built from code: nothing is downloaded).

Also usable from a config file by path, e.g. ``factory = "/abs/path/tests/toys.py:tiny_lm"``.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 32
SEQ_LEN = 12


class TinyLM(nn.Module):
    """A causal "language model" that returns logits only: the loop computes the loss."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids)
        # causal: position t sees the running mean of positions <= t
        h = h.cumsum(1) / torch.arange(1, h.shape[1] + 1, device=h.device)[None, :, None]
        return self.head(self.norm(torch.tanh(self.mix(h))))


def tiny_lm(seed: int = 0, **kwargs) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs)


def tiny_llama(seed: int = 0):
    """A randomly initialised 1-layer LlamaForCausalLM built from a config (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def lm_samples(
    n: int, seed: int = 0, min_len: int = 2, max_len: int = SEQ_LEN, no_loss_rows: tuple[int, ...] = ()
) -> list[dict[str, torch.Tensor]]:
    """Variable-length sequences right-padded to ``max_len``; padding has label -100.

    Rows in ``no_loss_rows`` carry no loss-bearing token at all (every label is -100).
    """
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.zeros(max_len, dtype=torch.long)
        ids[:length] = torch.randint(1, VOCAB, (length,), generator=g)
        mask = torch.zeros(max_len, dtype=torch.long)
        mask[:length] = 1
        labels = torch.full((max_len,), -100, dtype=torch.long)
        if i not in no_loss_rows:
            labels[:length] = ids[:length]
        samples.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return samples


class Blobs(torch.utils.data.Dataset):
    """A small, learnable 4-class classification set: {"x": float[8], "labels": int}."""

    def __init__(self, n: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        centers = torch.randn(4, 8, generator=g) * 3
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.x = centers[self.y] + torch.randn(n, 8, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class MLP(nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mlp(hidden: int = 16) -> MLP:
    return MLP(hidden)


def blobs_train(**_) -> Blobs:
    return Blobs(64, seed=0)


def blobs_eval(**_) -> Blobs:
    return Blobs(32, seed=1)


def accuracy(predictions: torch.Tensor, label_ids: torch.Tensor) -> dict[str, float]:
    return {"accuracy": (predictions.argmax(-1) == label_ids).float().mean().item()}


class CopyingDevice:
    """A plugin whose backend's ``to_device`` copies each batch, as a move to a second device does
    (none exists in CI), and keeps a weak reference to each copy's ``key`` tensor: ``alive()``
    counts the copies something still holds, as device memory would."""

    name = "copying_backend"

    def __init__(self, key: str) -> None:
        self.key, self.copies = key, []

    def create_backend(self, loop):
        import weakref

        from corelooper.backends.local import LocalBackend

        copies, key = self.copies, self.key

        class CopyingBackend(LocalBackend):
            def to_device(self, batch):
                moved = {k: v.clone() for k, v in batch.items()}
                copies.append(weakref.ref(moved[key]))
                return moved

        return CopyingBackend(torch.device("cpu"))

    def alive(self, but_last: bool = False) -> int:
        """Copies still referenced (``but_last``: leaving out the newest)."""
        return sum(r() is not None for r in (self.copies[:-1] if but_last else self.copies))
