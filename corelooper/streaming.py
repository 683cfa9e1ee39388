"""Streaming data: ``IterableDataset`` training, split over processes and dataloader workers,
with an exact resume through the dataset's own state.

Two ways to split a training stream (``train.stream_split``):

- ``"shards"`` (the default): every process x worker is a shard that keeps its own items (below);
  the checkpoint holds each shard's position, so a resume needs the same shard count;
- ``"global"``: one global order, as ``data.BatchLoader`` for map-style data. The stream is cut
  into global micro-batches of ``per_device x processes`` samples and rank ``r`` takes samples
  ``r*B .. (r+1)*B - 1`` of each (worker ``w`` of K reads every K-th micro-batch). The position
  is one number, samples of the stream's epoch consumed by all processes together, the same on
  every rank, so any number of processes and workers continues from it
  (``corelooper.elastic``): no sample repeated, none skipped. Every reader reads the whole stream
  (as accelerate's ``IterableDatasetShard``); a last, short micro-batch of an epoch is split
  evenly across ranks, padded with its own first samples (or dropped, ``dataloader_drop_last``).

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
import math
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


def _open_epoch(ds, epoch: int, position: int, ds_state: dict | None) -> Iterator:
    """The items of ``epoch`` after the first ``position``: from the dataset's own state when it
    has one, else by re-reading and skipping them."""
    if callable(getattr(ds, "set_epoch", None)):
        ds.set_epoch(epoch)
    if position > 0 and is_stateful(ds) and ds_state is not None:
        ds.load_state_dict(ds_state)
        return iter(ds)
    items = iter(ds)
    if position > 0:  # no dataset state: re-read the consumed part of the epoch
        for _ in islice(items, position):
            pass
    return items


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
            resumed = position > 0
            items = _open_epoch(ds, epoch, position, ds_state)
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


class _GlobalStream(IterableDataset):
    """Yields ``(batch, state)``: this rank's slice of every K-th global micro-batch of the stream
    (worker ``w`` of K takes micro-batches ``w, w + K, ...`` of this iteration, the order in which
    the DataLoader asks its workers), with the global position after that micro-batch."""

    def __init__(self, dataset, batch_size: int, collate_fn: Callable, drop_last: bool, rank: int,
                 world: int, workers: int, state: dict, cycle: bool):
        self.dataset, self.batch_size, self.collate_fn = dataset, batch_size, collate_fn
        self.drop_last, self.rank, self.world, self.workers = drop_last, rank, world, workers
        self.state, self.cycle = state, cycle

    def __iter__(self) -> Iterator[tuple[Any, dict]]:
        global _current
        info = torch.utils.data.get_worker_info()
        worker, k = (info.id if info is not None else 0), max(1, self.workers)
        _current = Shard(0, 1)  # every reader reads the whole stream
        size = self.batch_size * self.world
        epoch, position, ds_state = self.state["epoch"], self.state["position"], self.state.get("dataset")
        count = 0  # global micro-batches of this iteration so far
        while True:
            started, used = position, 0
            items = _open_epoch(self.dataset, epoch, position, ds_state)
            while chunk := list(islice(items, size)):
                position += len(chunk)
                if len(chunk) < size and self.drop_last:
                    break
                used, count = used + 1, count + 1
                if (count - 1) % k == worker:
                    yield self.collate_fn(self._slice(chunk)), self._state(epoch, position, len(chunk) < size)
            if not self.cycle or (started == 0 and used == 0):
                return  # an empty epoch would repeat forever
            epoch, position, ds_state = epoch + 1, 0, None

    def _slice(self, chunk: list) -> list:
        """Rank ``r``'s samples of a global micro-batch; a short one is split evenly, padded by
        repeating its own first samples (every rank gets a batch)."""
        b, w, r = self.batch_size, self.world, self.rank
        if len(chunk) == b * w or w == 1:
            return chunk[r * b : (r + 1) * b]
        per = math.ceil(len(chunk) / w)
        padded = [chunk[i % len(chunk)] for i in range(per * w)]
        return padded[r * per : (r + 1) * per]

    def _state(self, epoch: int, position: int, ended: bool) -> dict:
        if ended:  # the stream's epoch is over: the next one starts from its beginning
            return {"epoch": epoch + 1, "position": 0, "dataset": None}
        return {"epoch": epoch, "position": position,
                "dataset": self.dataset.state_dict() if is_stateful(self.dataset) else None}


def _check_readable_globally(dataset, num_workers: int) -> None:
    """The global split needs every reader to see the whole stream: a Hugging Face
    ``datasets.IterableDataset`` already split by node, or split by itself among DataLoader
    workers, yields only a part of it."""
    if type(dataset).__module__.split(".")[0] != "datasets" or not hasattr(dataset, "n_shards"):
        return
    name = type(dataset).__name__
    if getattr(dataset, "_distributed", None) is not None:  # datasets' split_dataset_by_node
        raise DataError(
            f'train.stream_split = "global" needs the whole stream on every process, but this {name} '
            "was split by datasets.distributed.split_dataset_by_node, so each process reads only its "
            "part. Pass the dataset before that split (corelooper gives each process its slice of "
            'every global micro-batch), or set train.stream_split = "shards".'
        )
    if num_workers > 0:
        raise DataError(
            f'train.stream_split = "global" needs the whole stream in every dataloader worker, but a '
            f"{name} splits its shards among DataLoader workers by itself ({num_workers} asked), so "
            "each worker would read only a part. Set train.dataloader_num_workers = 0 for this "
            'dataset, or train.stream_split = "shards" (which cannot resume on another world size).'
        )


class StreamingLoader:
    """Batches of an ``IterableDataset`` for one process, resumable through ``state_dict``.

    ``split="shards"``: each process x worker keeps its own shard of the stream; ``"global"``:
    every process reads one global order and takes its slice of each global micro-batch
    (resumable on another number of processes or workers; module docstring)."""

    def __init__(self, dataset, batch_size: int, collate_fn: Callable | None = None, *, rank: int = 0,
                 num_replicas: int = 1, num_workers: int = 0, drop_last: bool = False,
                 pin_memory: bool = False, cycle: bool = True, split: str = "shards"):
        if split not in ("shards", "global"):
            raise DataError(f'StreamingLoader split must be "shards" or "global", not {split!r}.')
        if split == "global":
            _check_readable_globally(dataset, num_workers)
        self.dataset, self.batch_size, self.split = dataset, batch_size, split
        self.collate_fn = collate_fn or default_collate
        self.rank, self.world, self.num_workers = rank, num_replicas, num_workers
        self.drop_last, self.pin_memory, self.cycle = drop_last, pin_memory, cycle
        self._states: dict[int, dict] = {}
        self._global = {"epoch": 0, "position": 0, "dataset": None}
        self._consumed = 0

    @property
    def num_shards(self) -> int:
        return self.world * max(1, self.num_workers)

    @property
    def micro_batch(self) -> int:
        """Samples of one micro-batch across all processes."""
        return self.batch_size * self.world

    def _stream(self) -> IterableDataset:
        if self.split == "global":
            return _GlobalStream(self.dataset, self.batch_size, self.collate_fn, self.drop_last, self.rank,
                                 self.world, self.num_workers, dict(self._global), self.cycle)
        k = max(1, self.num_workers)
        # Worker 0 is asked first: give it the shard whose turn it is, so the round-robin order
        # of batches continues exactly across a resume.
        return _ShardStream(self.dataset, self.batch_size, self.collate_fn, self.drop_last, self.rank,
                            self.world, self.num_workers, self._consumed % k, dict(self._states), self.cycle)

    def __iter__(self) -> Iterator[Any]:
        stream = self._stream()
        if self.num_workers == 0:
            source = iter(stream)
        else:
            source = iter(torch.utils.data.DataLoader(
                stream, batch_size=None, num_workers=self.num_workers, collate_fn=_identity,
                pin_memory=self.pin_memory,
            ))
        for batch, state in source:
            if self.split == "global":
                self._global = state
            else:
                self._states[state.pop("shard")] = state
            self._consumed += 1
            yield batch

    def state_dict(self) -> dict:
        if self.split == "global":
            return {"split": "global", "micro_batch": self.micro_batch, "batches": self._consumed,
                    **self._global}
        return {"num_shards": self.num_shards, "rank": self.rank, "batches": self._consumed,
                "shards": {str(k): v for k, v in self._states.items()}}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("split", "shards")
        if saved != self.split:
            raise CheckpointError(
                f'The checkpoint\'s data position is for train.stream_split = "{saved}", this run has '
                f'"{self.split}": the two split the stream differently, so neither position continues '
                f'the other. Resume with train.stream_split = "{saved}", or set train.ignore_data_skip '
                "= true to restart the stream from its beginning."
            )
        if saved == "global":
            self._global = {k: state[k] for k in ("epoch", "position", "dataset")}
            self._consumed = int(state["batches"])
            return
        if state.get("num_shards") != self.num_shards:
            raise CheckpointError(
                f"The checkpoint's data position is for {state.get('num_shards')} stream shards "
                f"(processes x dataloader workers), this run has {self.num_shards}: a stream split by "
                "shards cannot be re-split. Resume with the same number of processes and "
                "train.dataloader_num_workers, or set train.ignore_data_skip = true to restart the stream "
                'from its beginning; a run started with train.stream_split = "global" resumes on any '
                "number of processes and workers."
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
    """Restore the training loader's position (or warn how the stream restarts).

    A ``"global"`` split's position is the same on every rank: each reads ``data_state_0.json``,
    so a checkpoint of N processes resumes on any M (their geometry: ``elastic.prepare_resume``)."""
    loader = getattr(loop, "train_loader", None)
    if loader is None or not callable(getattr(loader, "load_state_dict", None)):
        return
    split = getattr(loader, "split", "shards")
    path = _data_state_path(directory, 0 if split == "global" else loop.backend.process_index)
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
    if split == "global" and state.get("micro_batch") != loader.micro_batch and loop.state.is_world_process_zero:
        print(f"corelooper: continuing the stream after sample {state['position']} of its epoch "
              f"{state['epoch']} (no sample repeated or skipped)", flush=True)
    _warn_if_rereading(loader, state)


def _warn_if_rereading(loader, state: dict) -> None:
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, IterableDataset) and not is_stateful(dataset):
        shards = state.get("shards", {}).values()
        skipped = max((s.get("position", 0) for s in shards), default=state.get("position", 0))
        logger.warning(
            "%s has no state_dict()/load_state_dict(): resuming re-reads the stream from the start of "
            "its epoch and skips up to its first %d items, already consumed. Implement "
            "them for an instant resume, or set train.ignore_data_skip = true to start from the "
            "beginning instead.", type(dataset).__name__, skipped,
        )
