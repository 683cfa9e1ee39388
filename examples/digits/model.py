"""A small MLP for 8x8 digit images."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, hidden: int = 128, dropout: float = 0.1, num_classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, hidden),
            nn.LayerNorm(hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.net(pixel_values)


def build(hidden: int = 128, dropout: float = 0.1) -> MLP:
    return MLP(hidden, dropout)
