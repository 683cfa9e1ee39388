"""Default data pipeline: seeded, rank-sharded, resumable batches; collators.

``BatchLoader`` decides which sample indices form each batch *before* loading anything, so a
resume skips the seen part of an epoch by index (nothing is loaded or collated for it).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from ..errors import DataError


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


class BatchLoader:
    """Batches of one epoch for one process.

    Training: the epoch permutation is cut into *global* batches of ``batch_size * num_replicas``
    samples and process ``rank`` takes its slice, so N processes with batch B see exactly the
    samples one process with batch N*B would. A last, short global batch is split evenly
    (padded by wrapping to the start of the epoch when needed, as accelerate does) unless
    ``drop_last``. The position in an epoch is global, in samples consumed by all processes
    together (``skip_samples``), so a run resumed on another number of processes continues the
    same order (the ``resume_position`` provider rewrites it).

    Evaluation (``shuffle=False, contiguous=True``): each rank takes a contiguous block with no
    padding, so gathering in rank order restores dataset order without duplicates.
    """

    def __init__(
        self,
        dataset,
        batch_size: int,
        collate_fn: Callable[[list], Any] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
        contiguous: bool = False,
        lengths: Sequence[int] | None = None,
    ):
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn or default_collate
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.contiguous = contiguous
        self.lengths = lengths
        """Per-sample lengths: when given (``group_by_length``), each global batch holds samples
        of similar length (``collators.length_grouped_order``; still seeded per epoch)."""
        self.epoch = 0
        self._skip_samples = 0
        self._fast_tensors = collate_fn is None and isinstance(dataset, torch.utils.data.TensorDataset)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip(self, num_batches: int) -> None:
        """Start the next iteration ``num_batches`` (per-rank) batches into the epoch, by index."""
        per_batch = self.batch_size * (1 if self.contiguous else self.num_replicas)
        self._skip_samples = num_batches * per_batch

    def skip_samples(self, samples: int) -> None:
        """Start the next iteration after the first ``samples`` samples of the epoch's global
        order (all ranks together), by index: nothing is loaded for them."""
        self._skip_samples = samples

    def batch_indices(self, start: int = 0) -> list[list[int]]:
        """This rank's batches of the epoch, after the first ``start`` samples of its order."""
        n = len(self.dataset)
        if self.lengths is not None and self.shuffle and not self.contiguous:
            order = length_grouped_order(
                self.lengths, self.batch_size * self.num_replicas, self.seed, self.epoch
            )
        else:
            order = epoch_permutation(n, self.seed, self.epoch, self.shuffle)
        B, W, r = self.batch_size, self.num_replicas, self.rank
        if self.contiguous:
            per_rank = math.ceil(n / W)
            mine = order[r * per_rank : (r + 1) * per_rank]
            return [mine[i : i + B] for i in range(start, len(mine), B)]
        batches = []
        for first in range(start, n, B * W):
            chunk, per = order[first : first + B * W], B
            if len(chunk) < B * W:
                if self.drop_last:
                    break
                per = math.ceil(len(chunk) / W)
                chunk += [order[i % n] for i in range(per * W - len(chunk))]
            batches.append(chunk[r * per : (r + 1) * per])
        return batches

    def __len__(self) -> int:
        if self.contiguous:
            return len(self.batch_indices())
        n, global_batch = len(self.dataset), self.batch_size * self.num_replicas
        return n // global_batch if self.drop_last else math.ceil(n / global_batch)

    def fetch(self, indices: Sequence[int]):
        """Load and collate one batch. ``TensorDataset`` is sliced in one go (same result as
        collating sample by sample); datasets with ``__getitems__`` are asked once per batch."""
        ds = self.dataset
        if self._fast_tensors:
            idx = torch.as_tensor(indices)
            return [t[idx] for t in ds.tensors]
        getitems = getattr(ds, "__getitems__", None)
        samples = getitems(list(indices)) if getitems else [ds[i] for i in indices]
        return self.collate_fn(samples)

    def __iter__(self) -> Iterator[Any]:
        batches = self.batch_indices(self._skip_samples)
        self._skip_samples = 0
        if self.num_workers == 0:
            return map(self.fetch, batches)
        # Its own generator: workers' seeds would otherwise be drawn from the global RNG,
        # which a resume restores *after* this point in the epoch (dropout would diverge).
        return iter(
            torch.utils.data.DataLoader(
                self.dataset,
                batch_sampler=batches,
                collate_fn=self.collate_fn,
                num_workers=self.num_workers,
                pin_memory=self.pin_memory,
                persistent_workers=False,
                generator=torch.Generator().manual_seed(self.seed + self.epoch),
            )
        )


def count_loss_items(batch, loss_type: str) -> torch.Tensor | int:
    """Loss-bearing items in a batch: labels != -100 (after the causal shift), else rows."""
    last = batch[-1] if isinstance(batch, (list, tuple)) and len(batch) > 1 else None
    labels = batch.get("labels") if isinstance(batch, dict) else last
    if labels is None or not torch.is_tensor(labels):
        return batch_rows(batch)
    if loss_type == "mse" or labels.is_floating_point():
        return labels.numel()
    if loss_type == "auto":
        loss_type = resolve_loss_type(batch)
    if loss_type == "causal_lm":
        labels = labels[..., 1:]
    return (labels != -100).sum()


def resolve_loss_type(batch) -> str:
    """``auto`` rule: causal-LM when labels have the shape of input_ids, MSE for float labels."""
    if isinstance(batch, dict):
        labels, ids = batch.get("labels"), batch.get("input_ids")
        if not torch.is_tensor(labels):  # none, or not collated into a tensor (the loss names it)
            return "cross_entropy"
        if labels.is_floating_point():
            return "mse"
        if torch.is_tensor(ids) and labels.shape == ids.shape and ids.dim() == 2:
            return "causal_lm"
    elif isinstance(batch, (list, tuple)) and torch.is_tensor(batch[-1]) and batch[-1].is_floating_point():
        return "mse"
    return "cross_entropy"


def batch_rows(batch) -> int:
    """Samples in a batch: the samples packed into its rows, else its rows (``tensor_rows``)."""
    packed = packed_samples(batch) if isinstance(batch, dict) else None
    return tensor_rows(batch) if packed is None else packed


def tensor_rows(batch, default: int | None = 1) -> int | None:
    """Rows of a batch: dim 0 of its first tensor, searched depth-first through mappings, lists
    and tuples (``default`` when it holds none). What a batch is cut along (auto batch size)."""
    if torch.is_tensor(batch):
        return int(batch.shape[0]) if batch.dim() else default
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    for v in batch if isinstance(batch, (list, tuple)) else ():
        n = tensor_rows(v, None)
        if n is not None:
            return n
    return default


def packed_samples(batch: dict) -> int | None:
    """The samples of a packed batch (None when its rows are one sample each): flash-attention's
    ``cu_seq_lens_q`` boundaries, else the restarts of ``position_ids`` that begin a segment with
    a label to learn (a row's padding restarts the positions too, with labels all -100)."""
    cu = batch.get("cu_seq_lens_q")
    if torch.is_tensor(cu) and cu.dim() == 1:
        return cu.numel() - 1
    pos, labels = batch.get("position_ids"), batch.get("labels")
    if not (
        torch.is_tensor(pos) and pos.dim() == 2 and torch.is_tensor(labels) and labels.shape == pos.shape
    ):
        return None  # (without labels, left padding's repeated 0 positions would count as samples)
    starts = pos == 0
    if int(starts.sum()) <= pos.shape[0]:  # one start per row: rows are samples
        return None
    segment = starts.cumsum(-1) + torch.arange(pos.shape[0], device=pos.device)[:, None] * (pos.shape[1] + 1)
    return int(segment[labels != -100].unique().numel())


def count_input_tokens(batch) -> int:
    """Tokens fed to the model (``input_ids`` numel; 0 without input_ids; no device sync): what tokens
    per second count, padding too (``state.num_input_tokens_seen`` follows ``count_tokens_seen``)."""
    if isinstance(batch, dict) and torch.is_tensor(batch.get("input_ids")):
        return batch["input_ids"].numel()
    return 0


def length_grouped_order(
    lengths: Sequence[int], batch_size: int, seed: int, epoch: int, mega_batch_mult: int | None = None
) -> list[int]:
    """HF's ``get_length_grouped_indices``: a seeded random permutation cut into mega-batches of
    ``mega_batch_mult * batch_size`` samples (default, as HF: ``min(n // (4 * batch_size), 50)``,
    at least 1), each sorted by length (longest first), with the longest batch moved to the front
    (an OOM shows up on the first step, not hours later). The order of HF's
    ``LengthGroupedSampler`` for the same permutation (tests/test_length_grouped.py). Where it
    differs: ``batch_size`` is the global micro-batch (per-device size times processes) where HF
    passes the per-device size times gradient-accumulation steps, and the permutation is
    ``epoch_permutation`` (seed + epoch) where HF draws from torch's global generator."""
    if mega_batch_mult is None:
        mega_batch_mult = min(len(lengths) // (4 * max(1, batch_size)), 50)
    perm = epoch_permutation(len(lengths), seed, epoch, True)
    mega = max(1, mega_batch_mult) * batch_size
    megabatches = [sorted(perm[i : i + mega], key=lambda j: -lengths[j]) for i in range(0, len(perm), mega)]
    if megabatches:  # the longest sample (a mega-batch's head) to the very front
        k = max(range(len(megabatches)), key=lambda m: lengths[megabatches[m][0]])
        megabatches[0][0], megabatches[k][0] = megabatches[k][0], megabatches[0][0]
    return [i for m in megabatches for i in m]


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def pad_token_id_of(collator) -> int | None:
    """The padding id HF's "non_padding" count falls back to without an attention mask: the
    collator's ``pad_token_id`` (corelooper's collators), or its tokenizer's (HF's collators)."""
    for owner in (collator, getattr(collator, "tokenizer", None)):
        pad = getattr(owner, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return None


def count_tokens_seen(
    micro_batches, mode: str, backend=None, pad_token_id: int | None = None, main_input: str = "input_ids"
) -> int:
    """HF's ``_track_num_input_tokens`` for one optimizer step, summed over processes.

    ``"all"``: ``input_ids.numel()``; ``"non_padding"``: ``attention_mask.sum()``, else ids !=
    ``pad_token_id``, else (with a warning, as HF) every token; ``"no"``: 0. Batches without
    ``main_input`` are not counted (HF warns; here only in "non_padding", asked for explicitly).
    Shapes only (no sync) for "all" in one process; else the count is read once per step."""
    if mode == "no":
        return 0
    counts = []
    for batch in micro_batches:
        ids = batch.get(main_input) if isinstance(batch, dict) else None
        if not torch.is_tensor(ids):
            if mode == "non_padding":  # asked for explicitly ("all" is the default: stay quiet)
                _warn_once(
                    f"include_num_input_tokens_seen: the batches have no {main_input!r}; tokens are "
                    "not counted (set the model's main_input_name)."
                )
            continue
        if mode != "non_padding":
            counts.append(ids.numel())
        elif torch.is_tensor(batch.get("attention_mask")):
            counts.append(batch["attention_mask"].sum())
        elif pad_token_id is not None:
            counts.append((ids != pad_token_id).sum())
        else:
            _warn_once(
                "include_num_input_tokens_seen = 'non_padding': no attention_mask and no "
                "pad_token_id, counting all tokens (as HF)."
            )
            counts.append(ids.numel())
    total = sum(counts)
    if getattr(backend, "num_processes", 1) > 1:  # exact, as HF's gather: ranks may pad to other lengths
        total = backend.reduce_sum(torch.as_tensor(total, dtype=torch.int64, device=backend.device))
    return int(total)


def sample_lengths(dataset, length_column_name: str = "length") -> list[int]:
    """Per-sample lengths for ``group_by_length``: ``dataset.lengths``, a ``length`` column, or
    the length of each sample's ``input_ids`` (read once)."""
    lengths = getattr(dataset, "lengths", None)
    if lengths is not None:
        lengths = list(lengths)
        if len(lengths) != len(dataset):
            raise DataError(f"dataset.lengths has {len(lengths)} entries for {len(dataset)} samples.")
        return [int(x) for x in lengths]
    out = []
    for i in range(len(dataset)):
        sample = dataset[i]
        if isinstance(sample, Mapping) and length_column_name in sample:
            out.append(int(sample[length_column_name]))
        elif isinstance(sample, Mapping) and "input_ids" in sample:
            ids = sample["input_ids"]
            out.append(int(ids.shape[-1]) if torch.is_tensor(ids) else len(ids))
        else:
            raise DataError(
                f"train.group_by_length: sample {i} has no {length_column_name!r} and no "
                "'input_ids' to measure. Give the dataset a `lengths` attribute or a length "
                "column."
            )
    return out
