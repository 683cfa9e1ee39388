"""A tiny, learnable classification task for the HPO tests (built from code, nothing downloaded)."""

from __future__ import annotations

import torch


class Blobs(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        centers = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)) * 2
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.x = centers[self.y] + torch.randn(n, 8, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


class MLP(torch.nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4)
        )

    def forward(self, x):
        return self.net(x)


def model(hidden: int = 16) -> MLP:
    return MLP(hidden)


def train_set(**_) -> Blobs:
    return Blobs(96, seed=1)


def eval_set(**_) -> Blobs:
    return Blobs(48, seed=2)
