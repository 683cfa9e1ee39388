"""Streaming data: ``IterableDataset`` training, sharded over processes and dataloader workers,
with an exact resume through the dataset's own state.

Sharding: with W processes and K dataloader workers there are W*K shards; shard
``rank * K + local`` keeps items ``i`` of the stream with ``i % (W*K) == shard`` (so every item is
seen by exactly one shard), unless the dataset says ``shards_itself = True`` and reads only its
part itself (``current_shard()`` tells it which, inside ``__iter__``).

Batches are collated inside the shard (in the worker process) and come back with the shard's
position *after* that batch: ``{"epoch", "position", "dataset": dataset.state_dict()}``. The
loader records the state of the last batch the loop actually *consumed* from each shard
(prefetched batches do not count), and the checkpoint stores it (``data_state_{rank}.json``).

Resume:
- a dataset with ``state_dict()``/``load_state_dict(d)`` (the torchdata ``Stateful`` protocol: the
  state says how far the current ``__iter__`` got; after ``load_state_dict`` the next ``__iter__``
  continues from there) continues exactly where it stopped, reading nothing twice;
- a dataset without them is re-read from the start of its epoch and the consumed items are
  skipped (exact when the stream is deterministic, but it costs the reading), with a warning;
- ``train.ignore_data_skip = true`` (HF's name) starts the stream from the beginning, with a warning.

When a shard's stream ends, it starts the next epoch (calling ``dataset.set_epoch(epoch)`` when
the dataset has it), so training runs for ``train.max_steps`` and processes never wait on each
other for a batch that will not come.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate

from .errors import CheckpointError, DataError

logger = logging.getLogger("corelooper.streaming")


@dataclass(frozen=True)
class Shard:
    index: int
    count: int


_current = Shard(0, 1)


def current_shard() -> Shard:
    """Inside a dataset's ``__iter__``: which of the process x worker shards is reading."""
    return _current


def is_stateful(dataset) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


def _identity(x):
    return x


class _ShardStream(IterableDataset):
    """Yields ``(batch, state)`` for one shard; runs in a dataloader worker (or in the process)."""

    def __init__(self, dataset, batch_size: int, collate_fn: Callable, drop_last: bool, rank: int,
                 world: int, workers: int, rotation: int, states: dict[int, dict], cycle: bool):
        self.dataset, self.batch_size, self.collate_fn = dataset, batch_size, collate_fn
        self.drop_last, self.rank, self.world, self.workers = drop_last, rank, world, workers
        self.rotation, self.states, self.cycle = rotation, states, cycle

    def __iter__(self) -> Iterator[tuple[Any, dict]]:
        global _current
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        k = max(1, self.workers)
        shard = self.rank * k + (worker + self.rotation) % k
        count = self.world * k
        _current = Shard(shard, count)
        ds = self.dataset
        own, stateful = bool(getattr(ds, "shards_itself", False)), is_stateful(ds)
        state = self.states.get(shard) or {"epoch": 0, "position": 0, "dataset": None}
        epoch, position, ds_state = state["epoch"], state["position"], state.get("dataset")
        while True:
            if callable(getattr(ds, "set_epoch", None)):
                ds.set_epoch(epoch)
            resumed = position > 0
            if resumed and stateful and ds_state is not None:
                ds.load_state_dict(ds_state)
                items = iter(ds)
            else:
                items = iter(ds)
                if resumed:  # no dataset state: re-read the consumed part of the epoch
                    for _ in islice(items, position):
                        pass
            produced = False
            buf = []
            for item in items:
                p = position
                position += 1
                if not own and p % count != shard:
                    continue
                buf.append(item)
                if len(buf) == self.batch_size:
                    produced = True
                    yield self.collate_fn(buf), self._state(shard, epoch, position, stateful)
                    buf = []
            if buf and not self.drop_last:
                produced = True
                yield self.collate_fn(buf), self._state(shard, epoch, position, stateful)
            if not self.cycle or (not produced and not resumed):
                return  # an empty epoch would repeat forever
            epoch, position, ds_state = epoch + 1, 0, None

    def _state(self, shard: int, epoch: int, position: int, stateful: bool) -> dict:
        return {"shard": shard, "epoch": epoch, "position": position,
                "dataset": self.dataset.state_dict() if stateful else None}


class StreamingLoader:
    """Batches of an ``IterableDataset`` for one process, resumable through ``state_dict``."""

    def __init__(self, dataset, batch_size: int, collate_fn: Callable | None = None, *, rank: int = 0,
                 num_replicas: int = 1, num_workers: int = 0, drop_last: bool = False,
                 pin_memory: bool = False, cycle: bool = True):
        self.dataset, self.batch_size = dataset, batch_size
        self.collate_fn = collate_fn or default_collate
        self.rank, self.world, self.num_workers = rank, num_replicas, num_workers
        self.drop_last, self.pin_memory, self.cycle = drop_last, pin_memory, cycle
        self._states: dict[int, dict] = {}
        self._consumed = 0

    @property
    def num_shards(self) -> int:
        return self.world * max(1, self.num_workers)

    def __iter__(self) -> Iterator[Any]:
        k = max(1, self.num_workers)
        # Worker 0 is asked first: give it the shard whose turn it is, so the round-robin order
        # of batches continues exactly across a resume.
        stream = _ShardStream(self.dataset, self.batch_size, self.collate_fn, self.drop_last, self.rank,
                              self.world, self.num_workers, self._consumed % k, dict(self._states), self.cycle)
        if self.num_workers == 0:
            source = iter(stream)
        else:
            source = iter(torch.utils.data.DataLoader(
                stream, batch_size=None, num_workers=self.num_workers, collate_fn=_identity,
                pin_memory=self.pin_memory,
            ))
        for batch, state in source:
            self._states[state.pop("shard")] = state
            self._consumed += 1
            yield batch

    def state_dict(self) -> dict:
        return {"num_shards": self.num_shards, "rank": self.rank, "batches": self._consumed,
                "shards": {str(k): v for k, v in self._states.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_shards") != self.num_shards:
            raise CheckpointError(
                f"The checkpoint's data position is for {state.get('num_shards')} stream shards "
                f"(processes x dataloader workers), this run has {self.num_shards}. Resume with the "
                "same number of processes and train.dataloader_num_workers, or set "
                "train.ignore_data_skip = true to restart the stream from its beginning."
            )
        self._states = {int(k): v for k, v in state["shards"].items()}
        self._consumed = int(state["batches"])


# -- checkpoint: data_state_{rank}.json (called from checkpoint.py) ---------------------------------


def _data_state_path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"data_state_{rank}.json"


def save_data_state(loop, directory: Path) -> None:
    """Write the training loader's position, when it has one (streaming data)."""
    loader = getattr(loop, "train_loader", None)
    if loader is None or not callable(getattr(loader, "state_dict", None)):
        return
    state = loader.state_dict()
    try:
        text = json.dumps(state)
    except TypeError as e:
        raise DataError(
            f"The training dataset's state_dict() must be JSON-serialisable to be checkpointed ({e}). "
            f"Return numbers, strings, lists and dicts from {type(loop.train_dataset).__name__}.state_dict()."
        ) from None
    _data_state_path(directory, loop.backend.process_index).write_text(text)


def load_data_state(loop, directory: Path) -> None:
    """Restore the training loader's position (or warn how the stream restarts)."""
    loader = getattr(loop, "train_loader", None)
    if loader is None or not callable(getattr(loader, "load_state_dict", None)):
        return
    path = _data_state_path(directory, loop.backend.process_index)
    if loop.args.ignore_data_skip:
        logger.warning(
            "train.ignore_data_skip = true: the training stream starts again from its beginning, so the "
            "samples seen before the checkpoint are seen again."
        )
        return
    if not path.is_file():
        logger.warning(
            "Checkpoint %s has no data position (%s): the training stream starts again from its "
            "beginning.", directory, path.name,
        )
        return
    try:
        state = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{str(path)!r} is unreadable (truncated or corrupt?): {e}") from None
    loader.load_state_dict(state)
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, IterableDataset) and not is_stateful(dataset):
        skipped = max((s.get("position", 0) for s in state.get("shards", {}).values()), default=0)
        logger.warning(
            "%s has no state_dict()/load_state_dict(): resuming re-reads the stream from the start of "
            "its epoch and skips the %d items already consumed by this process's shards. Implement "
            "them for an instant resume, or set train.ignore_data_skip = true to start from the "
            "beginning instead.", type(dataset).__name__, skipped,
        )
