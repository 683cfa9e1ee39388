"""Start-up workload shared by every contender: an MLP on random in-memory data."""

import torch
from torch import nn


def model(**_):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def dataset(**_):
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(3200, 64, generator=g), torch.randint(0, 10, (3200,), generator=g)
    )
