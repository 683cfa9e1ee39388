"""Digits with a ``difficulty_score`` column: how far each image lies from its class's mean image.

The score is the distance to the class centroid divided by the class's mean distance, clipped
to [0.25, 4]: typical samples score about 1, unusual (hard) ones more.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from examples.digits.data import Digits


class ScoredDigits(Dataset):
    """Samples are ``{"pixel_values": float[64], "labels": int, "difficulty_score": float}``."""

    def __init__(self, split: str = "train"):
        base = Digits(split)
        self.x, self.y = base.x, base.y
        self.score = torch.empty(len(self.y))
        for c in self.y.unique():
            idx = (self.y == c).nonzero().squeeze(1)
            dist = (self.x[idx] - self.x[idx].mean(0)).norm(dim=1)
            self.score[idx] = (dist / dist.mean()).clamp(0.25, 4.0)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.x[i], "labels": self.y[i], "difficulty_score": self.score[i]}


def train_set(**_) -> ScoredDigits:
    return ScoredDigits("train")
