"""scikit-learn's bundled 8x8 digits (1,797 real images, no download), split 80/20."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Digits(Dataset):
    """Samples are ``{"pixel_values": float[64], "labels": int}``."""

    def __init__(self, split: str, eval_fraction: float = 0.2, seed: int = 0):
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x, dtype=torch.float32) / 16.0
        y = torch.tensor(y, dtype=torch.long)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        n_eval = int(len(x) * eval_fraction)
        idx = order[:n_eval] if split == "eval" else order[n_eval:]
        self.x, self.y = x[idx], y[idx]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.x[i], "labels": self.y[i]}

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        return [{"pixel_values": self.x[i], "labels": self.y[i]} for i in indices]


def train_set(**_) -> Digits:
    return Digits("train")


def eval_set(**_) -> Digits:
    return Digits("eval")


def accuracy(predictions: torch.Tensor, label_ids: torch.Tensor) -> dict[str, float]:
    return {"accuracy": (predictions.argmax(-1) == label_ids).float().mean().item()}
