"""Packing that never leaks attention: plans (which sample pieces share a row) and batches.

Two steps, so that the expensive one runs once per data set and the cheap one per batch:

* ``plan_packing(lengths, capacity, strategy)`` decides which pieces of which samples go into
  each packed row, from the sample lengths alone (``O(n log n)``: best-fit decreasing over the bins'
  remaining room, the query TRL answers with a segment tree, here with a bitset). Strategies, by TRL's names:
  ``"bfd"`` (whole samples; a sample longer than ``capacity`` is cut to it), ``"bfd_split"``
  (over-long samples are split into ``capacity``-sized pieces, each packed on its own) and
  ``"wrapped"`` (samples in order, cut at row ends, HF's ``group_texts`` layout).
* ``SegmentCollator`` turns rows of segments into a batch where every segment sees only
  itself: ``position_ids`` restart at 0 per segment, the first label of every segment is -100
  (it must not be predicted from the previous, unrelated segment, and unpacked training never
  predicts it either), and, for ``sdpa``/``eager`` attention, ``attention_mask`` is a 4-D float
  block-diagonal causal mask ``[B, 1, T, T]`` (0 allowed, ``finfo.min`` blocked). With
  position ids alone, HF's sdpa/eager attention attends across samples; flash-attention varlen
  separates them by ``position_ids``/``cu_seq_lens``, so its batches carry no mask and are one
  row without padding.

So a packed or padding-free batch gives every sample the logits it gets alone, and
``num_items_in_batch`` counts the same tokens as the padded batch (plugins/lm/tests/test_packing.py
checks both against a real ``transformers`` Llama).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from corelooper.errors import DataError

IGNORE_INDEX = -100
STRATEGIES = ("bfd", "bfd_split", "wrapped")

Piece = tuple[int, int, int]
"""``(sample index, start, end)``: tokens ``start:end`` of one sample."""


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity`` (each length <= it).

    Longest first (stable: equal lengths keep their order, so the plan is deterministic); each
    item goes into the open bin with the least room that still takes it, else a new bin. The
    best fit is found in a bitset of the room sizes open bins have (bit ``r`` set: some bin has
    ``r`` tokens free): the lowest set bit of ``present >> n`` is the smallest room ``>= n``.
    That is the segment tree's query (TRL) done by the CPU's word operations on a Python int:
    ``capacity / 64`` words per item, so the sort's ``O(n log n)`` dominates (64k samples in
    ~0.25 s here, 4x the tree; benchmarks/packing.py). Bins with equal room form a stack.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    present = 0
    by_room: dict[int, list[int]] = {}
    bins: list[list[int]] = []
    for i in order:
        n = lengths[i]
        if n <= 0:
            continue
        above = present >> n
        if above:
            room = n + (above & -above).bit_length() - 1
            stack = by_room[room]
            b = stack.pop()
            if not stack:
                present ^= 1 << room
        else:
            b, room = len(bins), capacity
            bins.append([])
        bins[b].append(i)
        left = room - n
        if left > 0:
            stack = by_room.setdefault(left, [])
            if not stack:
                present |= 1 << left
            stack.append(b)
    return bins


def plan_packing(lengths: Sequence[int], capacity: int, strategy: str = "bfd") -> list[list[Piece]]:
    """Which sample pieces form each packed row: ``rows[r] = [(sample, start, end), ...]``.

    Every row holds at most ``capacity`` tokens. ``bfd`` keeps samples whole (one longer than
    ``capacity`` keeps its first ``capacity`` tokens; truncate or drop them before packing to
    decide yourself), ``bfd_split`` cuts over-long samples into pieces packed separately, and
    ``wrapped`` keeps the data set's order and cuts samples at row ends.
    """
    if capacity <= 0:
        raise DataError(f"The packing length must be > 0, got {capacity}.")
    if strategy not in STRATEGIES:
        raise DataError(f"Packing strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}.")
    if strategy == "wrapped":
        return _wrapped(lengths, capacity)
    pieces: list[Piece] = []
    for i, n in enumerate(lengths):
        if strategy == "bfd":
            pieces.append((i, 0, min(n, capacity)))
        else:
            pieces.extend((i, s, min(s + capacity, n)) for s in range(0, n, capacity))
    bins = best_fit_decreasing([end - start for _, start, end in pieces], capacity)
    return [[pieces[j] for j in b] for b in bins]


def _wrapped(lengths: Sequence[int], capacity: int) -> list[list[Piece]]:
    rows: list[list[Piece]] = [[]]
    room = capacity
    for i, n in enumerate(lengths):
        start = 0
        while start < n:
            if room == 0:
                rows.append([])
                room = capacity
            take = min(room, n - start)
            rows[-1].append((i, start, start + take))
            start += take
            room -= take
    return [r for r in rows if r]


# -- batches ---------------------------------------------------------------------------------------


@dataclass
class Segment:
    """One sample (or piece of one) inside a packed row."""

    input_ids: Sequence[int]
    labels: Sequence[int]
    extras: Mapping[str, float]


def block_causal_mask(seq_lengths: Sequence[Sequence[int]], total: int, dtype=None):
    """``[B, 1, T, T]`` float mask: 0.0 where a token may attend (earlier tokens of its own
    segment), ``finfo(dtype).min`` elsewhere; with ``dtype=bool`` the boolean mask sdpa takes
    (True where a token may attend). Padding at a row's end is one more segment, so no row of
    the mask is fully blocked (a fully blocked row gives NaN in sdpa)."""
    import torch

    dtype = torch.bool if dtype is bool else (dtype or torch.float32)
    rows = len(seq_lengths)
    segment = torch.empty((rows, total), dtype=torch.long)
    for r, lens in enumerate(seq_lengths):
        ids = torch.repeat_interleave(torch.arange(len(lens)), torch.as_tensor(list(lens), dtype=torch.long))
        segment[r, : len(ids)] = ids
        segment[r, len(ids) :] = len(lens)  # the padding's own segment
    same = segment[:, :, None] == segment[:, None, :]
    causal = torch.ones((total, total), dtype=torch.bool).tril()
    allowed = same & causal
    if dtype == torch.bool:
        return allowed[:, None]
    mask = torch.zeros((rows, 1, total, total), dtype=dtype)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return mask


class SegmentCollator:
    """Rows of segments -> a leak-free causal-LM batch (see the module docstring).

    ``attn_implementation``: ``flash_attention_2``/``flash_attention_3``/``kernels-community/...``
    and ``SEGMENT_SDPA`` (plugins/lm/corelooper_lm/segment_attention.py) get one row of concatenated segments
    with ``position_ids`` and ``cu_seq_lens_q/k``, ``max_length_q/k``, no padding and no mask;
    ``"sdpa"`` gets a 4-D boolean block-diagonal causal mask (True: attend; sdpa's CPU kernel
    reads it at half the cost of a float mask), ``"eager"`` (or any other) the float mask.
    Per-sample numeric extras (``difficulty_score``) come back per token, shaped like
    ``labels`` (0 on padding), so a weighted loss multiplies them with the per-token loss.
    """

    def __init__(
        self,
        pad_token_id: int,
        attn_implementation: str | None = "sdpa",
        mask_dtype=None,
        pad_to_multiple_of: int | None = None,
    ):
        self.pad_token_id = pad_token_id
        self.flash = is_varlen(attn_implementation)
        self.bool_mask = attn_implementation in (None, "sdpa")
        self.mask_dtype = mask_dtype
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, rows: Sequence[Sequence[Segment]]) -> dict:
        if not rows or not all(rows):
            raise DataError("The packing collator got an empty batch (or a row with no samples).")
        if self.flash:
            rows = [[seg for row in rows for seg in row]]  # varlen: one row, no padding
        lengths = [[len(s.input_ids) for s in row] for row in rows]
        total = max(sum(x) for x in lengths)
        if self.pad_to_multiple_of and not self.flash:
            total = -(-total // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = _rows_to_tensors(rows, lengths, total, self.pad_token_id)
        if self.flash:
            batch.update(_flash_kwargs(lengths[0]))
        elif self.bool_mask:
            batch["attention_mask"] = block_causal_mask(lengths, total, bool)
        else:
            batch["attention_mask"] = block_causal_mask(lengths, total, self.mask_dtype)
        return batch


def _rows_to_tensors(
    rows: Sequence[Sequence[Segment]], lengths: list[list[int]], total: int, pad: int
) -> dict:
    """``input_ids``, ``labels`` (-100 on each segment's first token and on padding),
    ``position_ids`` (restarting per segment; the padding counts on as one more segment) and the
    per-token extras, built as flat lists and turned into tensors once."""
    import torch

    names = sorted({k for row in rows for s in row for k in s.extras})
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    extras: dict[str, list[float]] = {k: [] for k in names}
    for row, lens in zip(rows, lengths, strict=True):
        for seg, k in zip(row, lens, strict=True):
            if not k:
                continue
            seg_labels = _as_list(seg.labels)
            if len(seg_labels) != k:
                raise DataError(f"A packed segment has {k} input_ids but {len(seg_labels)} labels.")
            ids.extend(_as_list(seg.input_ids))
            labels.append(IGNORE_INDEX)  # never predicted from the previous segment
            labels.extend(seg_labels[1:])
            pos.extend(range(k))
            for name in names:
                extras[name].extend([float(seg.extras.get(name, 0.0))] * k)
        pad_n = total - sum(lens)
        ids.extend([pad] * pad_n)
        labels.extend([IGNORE_INDEX] * pad_n)
        pos.extend(range(pad_n))
        for name in names:
            extras[name].extend([0.0] * pad_n)
    shape = (len(rows), total)
    batch = {
        "input_ids": torch.tensor(ids, dtype=torch.long).view(shape),
        "labels": torch.tensor(labels, dtype=torch.long).view(shape),
        "position_ids": torch.tensor(pos, dtype=torch.long).view(shape),
    }
    batch.update({k: torch.tensor(v, dtype=torch.float32).view(shape) for k, v in extras.items()})
    return batch


def _as_list(values) -> list[int]:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _flash_kwargs(lengths: Sequence[int]) -> dict:
    import torch

    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.as_tensor(list(lengths), dtype=torch.int32), 0)
    longest = max(lengths)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def is_flash(attn_implementation: str | None) -> bool:
    """Whether this attention separates packed samples by position ids (varlen flash kernels)."""
    name = attn_implementation or ""
    return "flash" in name or name.startswith("kernels-community/")


def is_varlen(attn_implementation: str | None) -> bool:
    """Whether batches for this attention are one unpadded row with ``cu_seq_lens`` (flash
    kernels, and corelooper's ``SEGMENT_SDPA``) rather than rows with a 4-D mask."""
    from .segment_attention import SEGMENT_SDPA

    return is_flash(attn_implementation) or attn_implementation == SEGMENT_SDPA
