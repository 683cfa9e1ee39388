"""Loss spikes: a loss above ``spike_factor`` x the rolling median of the last ``spike_window``
losses (llm-foundry's loss-spike idea, with a median so one spike does not raise the bar).

What is read, and when:

- by default, the logged window losses (``logs["loss"]`` in ``on_log``: the loop already read
  it to the host, so this costs nothing);
- ``spike_per_step``: each optimizer step's loss, summed on the device from the micro-batches'
  losses and kept there; at the next log (or checkpoint) step the window's losses are
  all-reduced as one vector and read once, on every rank (no sync per step);
- ``on_spike = "skip_batch"``: each step's loss, read before ``optimizer.step()`` (one host sync
  and one all-reduce per step: the price of deciding before the update).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from pathlib import Path

#: Losses needed before a spike can be called (a median of 2 values means little).
MIN_HISTORY = 5


class SpikeDetector:
    def __init__(self, factor: float, window: int) -> None:
        self.factor = factor
        self.history: deque[float] = deque(maxlen=max(window, MIN_HISTORY))

    def check(self, loss: float) -> float | None:
        """The rolling median when ``loss`` is a spike (not added to the history), else None."""
        if not math.isfinite(loss):
            return None  # the non-finite guard's business
        if len(self.history) >= MIN_HISTORY:
            median = statistics.median(self.history)
            if median > 0 and loss > self.factor * median:
                return median
        self.history.append(loss)
        return None

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history.clear()
        self.history.extend(state.get("history", []))


class SkippedBatches:
    """Steps skipped for a spike, in ``output_dir/doctor/skipped_batches.jsonl``.

    A resume starts from a checkpoint that may predate the skip, and replays the same data
    order: the step is skipped again from this file (and from the checkpoint's copy), without
    needing the loss to spike again.
    """

    def __init__(self, output_dir: str) -> None:
        self.path = Path(output_dir) / "doctor" / "skipped_batches.jsonl"
        self.steps: dict[int, list | None] = {}

    def load(self) -> None:
        if not self.path.is_file():
            return
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            self.steps[int(rec["step"])] = rec.get("sample_indices")

    def add(self, record: dict, write: bool) -> None:
        self.steps[int(record["step"])] = record.get("sample_indices")
        if write:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def should_skip(self, step: int) -> bool:
        return step in self.steps


def append_spike(output_dir: str, record: dict) -> None:
    path = Path(output_dir) / "doctor" / "spikes.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def step_sample_indices(loop, position: int, micro_batches: int) -> list[int] | None:
    """Dataset indices of the step whose first micro-batch is ``position`` in the epoch, when
    the loader decides batches by index (corelooper's BatchLoader); None otherwise."""
    loader = getattr(loop, "train_loader", None)
    batch_indices = getattr(loader, "batch_indices", None)
    if not callable(batch_indices):
        return None
    batches = batch_indices()[position : position + micro_batches]
    return [i for b in batches for i in b]
