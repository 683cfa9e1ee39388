"""Iterable (streaming) datasets for the streaming tests: every sample carries its stream index."""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset


def sample(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(8, generator=g)
    return {"x": x, "labels": torch.tensor(int(x[:3].argmax())), "idx": torch.tensor(i)}


class Stream(IterableDataset):
    """``n`` samples read in order, like lines of a file; no state: a resume must re-read."""

    def __init__(self, n: int = 64):
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield sample(i)


class StatefulStream(Stream):
    """The same stream with the torchdata ``Stateful`` protocol: resumes without re-reading."""

    def __init__(self, n: int = 64):
        super().__init__(n)
        self._pos = 0
        self._start = 0
        self.reads = 0

    def __iter__(self):
        start, self._start = self._start, 0
        for i in range(start, self.n):
            self._pos = i + 1
            self.reads += 1
            yield sample(i)

    def state_dict(self) -> dict:
        return {"pos": self._pos}

    def load_state_dict(self, state: dict) -> None:
        self._start = state["pos"]


class Recorder(torch.nn.Module):
    """A classifier that records the stream index of every training sample it sees, per call."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        self.seen: list[list[int]] = []

    def forward(self, x, idx=None):
        if self.training and idx is not None:
            self.seen.append(idx.tolist())
        return self.net(x)


def stream_train(**kwargs):
    return StatefulStream(**kwargs)


def stateless_train(**kwargs):
    return Stream(**kwargs)


def recorder(**_):
    return Recorder()
