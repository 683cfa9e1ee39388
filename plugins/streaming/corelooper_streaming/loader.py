"""Streaming data: ``IterableDataset`` training, split over processes and dataloader workers,
with an exact resume through the dataset's own state.

Two ways to split a training stream (``train.stream_split``), and ``"auto"`` (the default), which
picks one (``choose_split``, which also says why):

- ``"global"``: one global order, as ``data.BatchLoader`` for map-style data. The stream is cut
  into global micro-batches of ``per_device x processes`` samples and rank ``r`` takes samples
  ``r*B .. (r+1)*B - 1`` of each (worker ``w`` of K reads every K-th micro-batch). The position
  is one number, samples of the stream's epoch consumed by all processes together, the same on
  every rank, so any number of processes and workers continues from it
  (the corelooper-elastic-resume plugin): no sample repeated, none skipped. Every reader reads the whole stream
  (as accelerate's ``IterableDatasetShard``); a last, short micro-batch of an epoch is split
  evenly across ranks, padded with its own first samples (or dropped, ``dataloader_drop_last``).
  ``"auto"`` picks it for every stream that does not split itself: there, every shard reads the
  whole stream anyway, so the global order costs no more reading;
- ``"shards"``: every process x worker is a shard that keeps its own items (below); the
  checkpoint holds each shard's position, so a resume needs the same shard count. ``"auto"``
  picks it where the dataset splits the stream itself and the global order would cost more
  reading or cannot work: ``shards_itself = True``, a Hugging Face ``datasets.IterableDataset``
  read by dataloader workers (it gives each worker its own shards) or already split by
  ``split_dataset_by_node``; and to continue a checkpoint written in shards mode.

Sharding: with W processes and K dataloader workers there are W*K shards; shard
``rank * K + worker`` keeps items ``i`` of the stream with ``i % (W*K) == shard`` (so every item
is seen by exactly one shard), except for the parts the dataset splits off itself: a dataset with
``shards_itself = True`` reads only its part (``current_shard()`` tells it which, inside
``__iter__``); a Hugging Face ``datasets.IterableDataset`` gives each DataLoader worker its own
shards (or, split by ``split_dataset_by_node``, each process its part), and corelooper splits only
what is left (``_own_part``): every item is read once per epoch, also with fewer dataset shards
than workers (the workers without one read nothing).

Batches are collated inside the shard (in the worker process) and come back with the shard's
position *after* that batch: ``{"epoch", "position", "dataset": dataset.state_dict()}``. The
loader yields them round-robin over the shards, from the one whose turn it is (``next`` in the
checkpoint), records the state of the last batch the loop actually *consumed* from each shard
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
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate

from corelooper.errors import CheckpointError, DataError

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
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None)
    )


def _identity(x):
    return x


def _is_hf_stream(dataset) -> bool:
    """A Hugging Face ``datasets.IterableDataset`` (without importing datasets)."""
    return type(dataset).__module__.split(".")[0] == "datasets" and hasattr(dataset, "n_shards")


def _splits_itself(dataset, num_workers: int) -> tuple[bool, bool]:
    """Whether the dataset itself gives each (process, dataloader worker) only its part."""
    if getattr(dataset, "shards_itself", False):
        return True, True
    if _is_hf_stream(dataset):  # its workers split its shards; split_dataset_by_node, its ranks
        return getattr(dataset, "_distributed", None) is not None, num_workers > 0
    return False, False


def _own_part(dataset, rank: int, world: int, worker: int, workers: int) -> tuple[int, int]:
    """``(m, i)``: shard ``rank x worker`` keeps the items ``p`` the dataset yields to it with
    ``p % m == i``, splitting only what the dataset does not split itself."""
    ranks_split, workers_split = _splits_itself(dataset, workers)
    k = 1 if workers_split else max(1, workers)
    return (1 if ranks_split else world) * k, (0 if ranks_split else rank) * k + (
        0 if workers_split else worker
    )


@dataclass(frozen=True)
class Split:
    """The split a training stream gets (``train.stream_split``): ``mode`` is "shards" or
    "global", ``why`` says why, ``to_global`` what a run would change to get "global"."""

    mode: str
    why: str
    to_global: str = ""


def choose_split(dataset, requested: str, num_workers: int) -> Split:
    """``"auto"``: "global" unless the dataset splits the stream itself (module docstring)."""
    if requested not in ("auto", "shards", "global"):
        raise DataError(f'train.stream_split must be "auto", "shards" or "global", not {requested!r}.')
    if requested == "global":
        return Split("global", "as configured")
    if requested == "shards":
        auto = choose_split(dataset, "auto", num_workers)
        return Split(
            "shards", "as configured", auto.to_global or 'set train.stream_split = "auto" or "global"'
        )
    name = type(dataset).__name__
    if getattr(dataset, "shards_itself", False):
        return Split(
            "shards",
            f'"auto": {name} sets shards_itself = True and reads only its shard',
            'set train.stream_split = "global" (every process and worker then reads the whole stream)',
        )
    if _is_hf_stream(dataset) and getattr(dataset, "_distributed", None) is not None:
        return Split(
            "shards",
            f'"auto": this {name} was split by datasets.distributed.split_dataset_by_node',
            "pass the dataset before that split",
        )
    if _is_hf_stream(dataset) and num_workers > 0:
        return Split(
            "shards",
            f'"auto": a {name} splits its shards among the {num_workers} dataloader workers itself',
            "set train.dataloader_num_workers = 0",
        )
    return Split(
        "global",
        f'"auto": {name} does not split itself, so every reader reads the whole stream in either mode',
    )


def saved_split(directory) -> str | None:
    """The split a checkpoint's stream position was written with (None: it has none)."""
    try:
        state = json.loads(_data_state_path(directory, 0).read_text())
    except (OSError, ValueError):
        return None
    return state.get("split", "shards") if isinstance(state, dict) else None


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
    """Yields ``(batch, state)`` for one shard, then ``(None, {"shard", "end": True})`` when it
    ends; runs in a dataloader worker (or in the process). Worker ``w`` reads shard
    ``rank * K + w`` (a Hugging Face dataset gives its own shards to the worker id)."""

    def __init__(
        self,
        dataset,
        batch_size: int,
        collate_fn: Callable,
        drop_last: bool,
        rank: int,
        world: int,
        workers: int,
        states: dict[int, dict],
        cycle: bool,
        epoch: int = 0,
    ):
        self.dataset, self.batch_size, self.collate_fn = dataset, batch_size, collate_fn
        self.drop_last, self.rank, self.world, self.workers = drop_last, rank, world, workers
        self.states, self.cycle, self.epoch = states, cycle, epoch

    def __iter__(self) -> Iterator[tuple[Any, dict]]:
        global _current
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        shard = self.rank * max(1, self.workers) + worker
        _current = Shard(shard, self.world * max(1, self.workers))
        ds = self.dataset
        stateful = is_stateful(ds)
        m, keep = _own_part(ds, self.rank, self.world, worker, self.workers)
        state = self.states.get(shard) or {"epoch": self.epoch, "position": 0, "dataset": None}
        epoch, position, ds_state = state["epoch"], state["position"], state.get("dataset")
        while True:
            resumed = position > 0
            items = _open_epoch(ds, epoch, position, ds_state)
            produced = False
            buf = []
            for item in items:
                p = position
                position += 1
                if p % m != keep:
                    continue
                buf.append(item)
                if len(buf) == self.batch_size:
                    produced = True
                    yield self.collate_fn(buf), self._state(shard, epoch, position, stateful)
                    buf = []
            if buf and not self.drop_last:
                produced = True
                yield self.collate_fn(buf), self._state(shard, epoch, position, stateful)
            if not self.cycle or (not produced and not resumed):  # an empty epoch would repeat forever
                yield None, {"shard": shard, "end": True}
                return
            epoch, position, ds_state = epoch + 1, 0, None

    def _state(self, shard: int, epoch: int, position: int, stateful: bool) -> dict:
        return {
            "shard": shard,
            "epoch": epoch,
            "position": position,
            "dataset": self.dataset.state_dict() if stateful else None,
        }


class _GlobalStream(IterableDataset):
    """Yields ``(batch, state)``: this rank's slice of every K-th global micro-batch of the stream
    (worker ``w`` of K takes micro-batches ``w, w + K, ...`` of this iteration, the order in which
    the DataLoader asks its workers), with the global position after that micro-batch."""

    def __init__(
        self,
        dataset,
        batch_size: int,
        collate_fn: Callable,
        drop_last: bool,
        rank: int,
        world: int,
        workers: int,
        state: dict,
        cycle: bool,
    ):
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
        return {
            "epoch": epoch,
            "position": position,
            "dataset": self.dataset.state_dict() if is_stateful(self.dataset) else None,
        }


def _check_readable_globally(dataset, num_workers: int) -> None:
    """The global split needs every reader to see the whole stream: a Hugging Face
    ``datasets.IterableDataset`` already split by node, or split by itself among DataLoader
    workers, yields only a part of it."""
    if not _is_hf_stream(dataset):
        return
    name = type(dataset).__name__
    if getattr(dataset, "_distributed", None) is not None:  # datasets' split_dataset_by_node
        raise DataError(
            f'train.stream_split = "global" needs the whole stream on every process, but this {name} '
            "was split by datasets.distributed.split_dataset_by_node, so each process reads only its "
            "part. Pass the dataset before that split (corelooper gives each process its slice of "
            'every global micro-batch), or set train.stream_split = "auto" or "shards" (which keep that '
            "split, and resume on the same number of processes only)."
        )
    if num_workers > 0:
        raise DataError(
            f'train.stream_split = "global" needs the whole stream in every dataloader worker, but a '
            f"{name} splits its shards among DataLoader workers by itself ({num_workers} asked), so "
            "each worker would read only a part. Set train.dataloader_num_workers = 0 for this "
            'dataset, or train.stream_split = "auto" or "shards" (each worker then reads its own '
            "shards, and the run resumes on the same number of processes and workers only)."
        )


class StreamingLoader:
    """Batches of an ``IterableDataset`` for one process, resumable through ``state_dict``.

    ``split="shards"``: each process x worker keeps its own shard of the stream; ``"global"``:
    every process reads one global order and takes its slice of each global micro-batch
    (resumable on another number of processes or workers); ``"auto"``: one of the two,
    ``choose_split`` (module docstring). ``choice.why`` says which and why."""

    def __init__(
        self,
        dataset,
        batch_size: int,
        collate_fn: Callable | None = None,
        *,
        rank: int = 0,
        num_replicas: int = 1,
        num_workers: int = 0,
        drop_last: bool = False,
        pin_memory: bool = False,
        cycle: bool = True,
        split: str = "shards",
    ):
        self.choice = choose_split(dataset, split, num_workers)
        if self.choice.mode == "global":
            _check_readable_globally(dataset, num_workers)
        if split == "auto":
            logger.info('Training stream split: "%s" (%s).', self.choice.mode, self.choice.why)
        self.dataset, self.batch_size, self.requested, self.split = (
            dataset,
            batch_size,
            split,
            self.choice.mode,
        )
        self.collate_fn = collate_fn or default_collate
        self.rank, self.world, self.num_workers = rank, num_replicas, num_workers
        self.drop_last, self.pin_memory, self.cycle = drop_last, pin_memory, cycle
        self._states: dict[int, dict] = {}
        self._global = {"epoch": 0, "position": 0, "dataset": None}
        self._consumed = 0
        self._turn = 0  # shards: the worker whose batch comes next
        self._epoch = 0  # shards, with the epochs of all workers together (_epochs_together)

    @property
    def num_shards(self) -> int:
        return self.world * max(1, self.num_workers)

    @property
    def micro_batch(self) -> int:
        """Samples of one micro-batch across all processes."""
        return self.batch_size * self.world

    @property
    def _epochs_together(self) -> bool:
        """A Hugging Face ``datasets.IterableDataset`` keeps its epoch in memory it shares with
        its DataLoader workers (``set_epoch`` in the main process, as datasets expects): one
        worker's ``set_epoch`` would move the others, so its workers read each epoch together,
        one DataLoader pass an epoch."""
        return self.split == "shards" and self.num_workers > 0 and _is_hf_stream(self.dataset)

    def _source(self, cycle: bool) -> Iterator[tuple[Any, dict]]:
        if self.split == "global":
            stream = _GlobalStream(
                self.dataset,
                self.batch_size,
                self.collate_fn,
                self.drop_last,
                self.rank,
                self.world,
                self.num_workers,
                dict(self._global),
                cycle,
            )
        else:
            stream = _ShardStream(
                self.dataset,
                self.batch_size,
                self.collate_fn,
                self.drop_last,
                self.rank,
                self.world,
                self.num_workers,
                dict(self._states),
                cycle,
                self._epoch if self._epochs_together else 0,
            )
        if self.num_workers == 0:
            source = iter(stream)
        else:
            source = iter(
                torch.utils.data.DataLoader(
                    stream,
                    batch_size=None,
                    num_workers=self.num_workers,
                    collate_fn=_identity,
                    pin_memory=self.pin_memory,
                )
            )
        return self._in_turn(source) if self.split == "shards" else source

    def __iter__(self) -> Iterator[Any]:
        if self._epochs_together:
            yield from self._epoch_passes()
            return
        for batch, state in self._source(self.cycle):
            self._record(state)
            yield batch

    def _record(self, state: dict) -> None:
        """The position after a batch the loop consumed."""
        if self.split == "global":
            self._global = state
        else:
            self._states[state.pop("shard")] = state
        self._consumed += 1

    def _epoch_passes(self) -> Iterator[Any]:
        """Shards, the workers' epochs together: a DataLoader pass of every shard an epoch, the
        dataset's epoch set here, in the main process."""
        while True:
            resumed = any(s["position"] > 0 for s in self._states.values())
            if callable(getattr(self.dataset, "set_epoch", None)):
                self.dataset.set_epoch(self._epoch)
            produced = False
            for batch, state in self._source(cycle=False):
                self._record(state)
                produced = True
                yield batch
            if not self.cycle or (not produced and not resumed):
                return  # an empty epoch would repeat forever
            self._epoch, self._states, self._turn = self._epoch + 1, {}, 0

    def _in_turn(self, source: Iterator) -> Iterator[tuple[Any, dict]]:
        """The shards' batches round-robin from the one whose turn it is: the DataLoader asks
        worker 0 first, and a resume may continue at another (the batches of the others wait).
        A shard that ended (its end marker) is left out of the turns, as the DataLoader leaves
        out its worker."""
        k = max(1, self.num_workers)
        waiting: dict[int, deque] = {w: deque() for w in range(k)}
        ended: set[int] = set()
        for batch, state in source:
            worker = state["shard"] - self.rank * k
            if state.get("end"):
                ended.add(worker)
            else:
                waiting[worker].append((batch, state))
            while True:
                for _ in range(k):  # past the ended shards with nothing left
                    if waiting[self._turn] or self._turn not in ended:
                        break
                    self._turn = (self._turn + 1) % k
                if not waiting[self._turn]:
                    break  # its next batch has not come yet
                item = waiting[self._turn].popleft()
                self._turn = (self._turn + 1) % k
                yield item

    def state_dict(self) -> dict:
        if self.split == "global":
            return {
                "split": "global",
                "micro_batch": self.micro_batch,
                "batches": self._consumed,
                **self._global,
            }
        return {
            "num_shards": self.num_shards,
            "rank": self.rank,
            "batches": self._consumed,
            "next": self._turn,
            "shards": {str(k): v for k, v in self._states.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """The position of a checkpoint's ``data_state_{rank}.json`` (rank 0's on a rank the run
        that saved it did not have): a global one continues on any number of processes and
        workers, a shards one only on the same shard count."""
        self._restore(state)
        _warn_if_rereading(self.dataset, state)

    def _restore(self, state: dict) -> None:
        saved = state.get("split", "shards")
        if saved == "shards" and self.split == "global" and self.requested == "auto":
            logger.warning(
                'train.stream_split = "auto": the checkpoint\'s stream is split by shards, so this '
                "run continues it in shards (a resume on the same number of processes and "
                "workers only; a new run of this configuration reads its stream globally)."
            )
            self.split, self.choice = "shards", Split("shards", "the checkpoint's stream is split by shards")
        if saved != self.split:
            raise CheckpointError(self._other_split(saved))
        if saved == "global":
            self._global = {k: state[k] for k in ("epoch", "position", "dataset")}
            self._consumed = int(state["batches"])
            if state.get("micro_batch") != self.micro_batch and self.rank == 0:
                print(
                    f"corelooper: continuing the stream after sample {state['position']} of its epoch "
                    f"{state['epoch']} (no sample repeated or skipped)",
                    flush=True,
                )
            return
        if state.get("num_shards") != self.num_shards:
            raise CheckpointError(
                f"The checkpoint's data position is for {state.get('num_shards')} stream shards "
                f"(processes x dataloader workers), this run has {self.num_shards}: a stream split by "
                "shards cannot be re-split. Resume with the same number of processes and "
                "train.dataloader_num_workers, or set train.ignore_data_skip = true to restart the stream "
                'from its beginning; a run whose stream is read globally (train.stream_split = "auto" '
                'for a stream that does not split itself, or "global") resumes on any number of '
                "processes and workers."
            )
        self._states = {int(k): v for k, v in state["shards"].items()}
        self._consumed = int(state["batches"])
        self._epoch = max((int(s["epoch"]) for s in self._states.values()), default=0)
        # checkpoints before "next": the DataLoader took the workers in turn from the first
        self._turn = int(state.get("next", self._consumed % max(1, self.num_workers)))

    def _other_split(self, saved: str) -> str:
        """The checkpoint's stream is split otherwise than this run's: neither position continues
        the other."""
        if saved == "global":
            fix = (
                f"To continue it, {self.choice.to_global}"
                if self.choice.to_global
                else 'Resume with train.stream_split = "global"'
            )
            return (
                f"The checkpoint's data position is for a stream read globally (train.stream_split = "
                f'"global"), this run splits it by shards ({self.choice.why}): neither position '
                f"continues the other. {fix}, or set train.ignore_data_skip = true to restart the "
                "stream from its beginning."
            )
        return (
            f'The checkpoint\'s data position is for train.stream_split = "{saved}", this run has '
            f'"{self.split}": the two split the stream differently, so neither position continues '
            f'the other. Resume with train.stream_split = "{saved}" (or "auto"), or set '
            "train.ignore_data_skip = true to restart the stream from its beginning."
        )


def _data_state_path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"data_state_{rank}.json"


def _warn_if_rereading(dataset, state: dict) -> None:
    if not is_stateful(dataset):
        shards = state.get("shards", {}).values()
        skipped = max((s.get("position", 0) for s in shards), default=state.get("position", 0))
        logger.warning(
            "%s has no state_dict()/load_state_dict(): resuming re-reads the stream from the start of "
            "its epoch and skips up to its first %d items, already consumed. Implement "
            "them for an instant resume, or set train.ignore_data_skip = true to start from the "
            "beginning instead.",
            type(dataset).__name__,
            skipped,
        )
