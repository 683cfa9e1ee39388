"""A streaming run for test_elastic_streaming.py (next to it), started by real launchers from a config.

``shuffled_stream``: a real ``IterableDataset`` of ``n`` samples (``streams.sample``: each carries
its index ``idx``) in a seeded order that changes every epoch (``set_epoch``), with the torchdata
``Stateful`` protocol. ``recording_mlp``: a classifier without dropout (the weights are a function
of the samples and their order only) that records the ``idx`` of every training sample it sees;
``RECORD_PLUGIN`` writes them per optimizer step to ``$RECORD_DIR`` and, at ``$STOP_AT_STEP``,
sends the process a real SIGTERM (as a scheduler's preemption would).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))  # streams.py; loaded by path
from streams import Recorder, sample  # noqa: E402


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    return torch.randperm(n, generator=g).tolist()


class ShuffledStream(IterableDataset):
    """``n`` samples in a seeded per-epoch order; ``state_dict`` says how far ``__iter__`` got."""

    def __init__(self, n: int = 64, seed: int = 7):
        self.n, self.seed = n, seed
        self.epoch, self._pos, self._start = 0, 0, 0
        self.reads = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        start, self._start = self._start, 0
        order = epoch_order(self.n, self.seed, self.epoch)
        for pos in range(start, self.n):
            self._pos = pos + 1
            self.reads += 1
            yield sample(order[pos])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self._pos}

    def load_state_dict(self, state: dict) -> None:
        assert state["epoch"] == self.epoch, (state, self.epoch)  # set_epoch comes first
        self._start = state["pos"]


def shuffled_stream(n: int = 64, **_) -> ShuffledStream:
    return ShuffledStream(n)


def recording_mlp(**_) -> Recorder:
    return Recorder()


RECORD_PLUGIN = """
import json
import os
import signal

STOP = int(os.environ.get("STOP_AT_STEP", "0"))


def on_step_end(loop, state):
    model = loop.backend.unwrap_model(loop.model)
    rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(os.environ["RECORD_DIR"], f"seen.rank{rank}.pid{os.getpid()}.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps({"step": state.global_step, "idx": [i for b in model.seen for i in b]}) + "\\n")
    model.seen.clear()
    if state.global_step == STOP:
        os.kill(os.getpid(), signal.SIGTERM)
"""
