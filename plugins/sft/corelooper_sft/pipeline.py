"""Raw rows -> tokenized rows (memory-mapped by ``datasets``) -> over-long policy -> packing,
plus the collator that matches: padded, padding-free, or packed (plugins/lm/corelooper_lm/packing.py)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from corelooper.errors import DataError

from .tokenize import IGNORE, RowTokenizer

logger = logging.getLogger("corelooper.sft")


@dataclass
class Stats:
    """What preparing one data set did; reported once per data set, shown by ``data preview``."""

    where: str
    samples: int = 0
    overlong: int = 0
    truncated: int = 0
    dropped: int = 0
    fully_masked_dropped: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    lengths: list[int] = field(default_factory=list, repr=False)

    def sentence(self, max_length: int, policy: str) -> str | None:
        if not self.overlong and not self.fully_masked_dropped:
            return None
        what = f"truncated to {max_length} tokens" if policy == "truncate" else "dropped"
        out = f"sft: {self.where}: {self.overlong} of {self.samples} samples are longer than max_length={max_length}: {what}"
        if self.fully_masked_dropped:
            out += f"; {self.fully_masked_dropped} left with no trained token after truncation were dropped"
        return out + "."


def as_hf_dataset(dataset, where: str):
    """A ``datasets.Dataset`` as-is; a list or map-style dataset of dict rows converted once."""
    import datasets

    if isinstance(dataset, datasets.Dataset):
        return dataset
    if isinstance(dataset, datasets.IterableDataset):
        raise DataError(f"{where}: streaming (iterable) data sets are not supported by corelooper-sft yet.")
    try:
        rows = [dict(dataset[i]) for i in range(len(dataset))]
    except (TypeError, ValueError) as e:
        raise DataError(f"{where}: rows must be dicts of columns ({type(e).__name__}: {e}).") from None
    if not rows:
        raise DataError(f"{where}: the data set is empty.")
    return datasets.Dataset.from_list(rows)


def tokenize_dataset(dataset, tokenizer, cfg: Mapping[str, Any], where: str, chat_template: str | None):
    import datasets

    datasets.disable_progress_bars()
    ds = as_hf_dataset(dataset, where)
    if len(ds) == 0:
        raise DataError(f"{where}: the data set is empty.")
    fn = RowTokenizer(tokenizer, cfg, where, chat_template)
    return ds.map(fn, with_indices=True, remove_columns=ds.column_names)


def apply_max_length(ds, cfg: Mapping[str, Any], packing: bool, stats: Stats):
    """Truncate or drop over-long rows (counted); ``bfd_split``/``wrapped`` packing splits them."""
    max_length = int(cfg["max_length"] or 0)
    lengths = list(ds["length"])
    stats.samples = len(lengths)
    if max_length <= 0 or (packing and cfg["packing_strategy"] != "bfd"):
        return ds  # no limit, or the packing plan splits over-long samples into pieces
    stats.overlong = sum(n > max_length for n in lengths)
    if not stats.overlong:
        return ds
    if cfg["overlong"] == "drop":
        stats.dropped = stats.overlong
        return ds.filter(lambda n: n <= max_length, input_columns="length")
    keep_end = cfg["truncation_mode"] == "keep_end"
    sl = slice(-max_length, None) if keep_end else slice(None, max_length)

    def cut(row):
        out = {**row, "untruncated_length": row["length"]}
        if row["length"] <= max_length:
            return out
        return {**out, "input_ids": row["input_ids"][sl], "labels": row["labels"][sl], "length": max_length}

    ds = ds.map(cut)
    stats.truncated = stats.overlong
    before = len(ds)
    ds = ds.filter(lambda labels: any(x != IGNORE for x in labels[1:]), input_columns="labels")
    stats.fully_masked_dropped = before - len(ds)
    return ds


class TokenizedRows:
    """Map-style view of tokenized rows: ``{"input_ids", "labels", <numeric extras>}`` per item."""

    def __init__(self, ds, stats: Stats):
        self.stats = stats
        self._lengths = list(ds["length"]) if "length" in ds.column_names else None
        self.untruncated = list(ds["untruncated_length"]) if "untruncated_length" in ds.column_names else None
        self.ds = ds.remove_columns([c for c in ("length", "untruncated_length") if c in ds.column_names])

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        return self.ds[int(i)]

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        return self.ds.__getitems__([int(i) for i in indices])

    @property
    def lengths(self) -> list[int]:
        return self._lengths if self._lengths is not None else [len(r["input_ids"]) for r in self.ds]


class PackedRows:
    """Packed rows: item ``r`` is the list of sample pieces (dicts) that share row ``r``."""

    def __init__(self, rows: TokenizedRows, capacity: int, strategy: str):
        from corelooper_lm.packing import plan_packing

        self.rows = rows
        self.stats = rows.stats
        self.plan = plan_packing(rows.lengths, capacity, strategy)

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, r: int) -> list[dict]:
        return self.__getitems__([r])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[list[dict]]:
        wanted = sorted({i for r in indices for i, _, _ in self.plan[int(r)]})
        fetched = dict(zip(wanted, self.rows.__getitems__(wanted), strict=True))
        out = []
        for r in indices:
            pieces = []
            for i, a, b in self.plan[int(r)]:
                row = fetched[i]
                pieces.append({**row, "input_ids": row["input_ids"][a:b], "labels": row["labels"][a:b]})
            out.append(pieces)
        return out

    @property
    def lengths(self) -> list[int]:
        return [sum(b - a for _, a, b in row) for row in self.plan]


def prepare(dataset, tokenizer, cfg: Mapping[str, Any], where: str, chat_template: str | None = None):
    """The data set as the model will see it: ``TokenizedRows`` or, when packing, ``PackedRows``."""
    packing = bool(cfg["packing"])
    stats = Stats(where)
    ds = tokenize_dataset(dataset, tokenizer, cfg, where, chat_template)
    ds = apply_max_length(ds, cfg, packing, stats)
    if len(ds) == 0:
        raise DataError(f"{where}: no sample is left after [sft] overlong = {cfg['overlong']!r}.")
    stats.lengths = list(ds["length"])
    stats.tokens = sum(stats.lengths)
    stats.trained_tokens = sum(sum(x != IGNORE for x in labels[1:]) for labels in ds["labels"])
    sentence = stats.sentence(int(cfg["max_length"] or 0), cfg["overlong"])
    if sentence:
        logger.warning(sentence)
    rows = TokenizedRows(ds, stats)
    if not packing:
        return rows
    if not cfg["max_length"]:
        raise DataError("[sft] packing = true needs [sft] max_length > 0: the length of a packed row.")
    return PackedRows(rows, int(cfg["max_length"]), cfg["packing_strategy"])


class SFTCollator:
    """Batches for ``mode`` ``"padded"`` (HF's usual right padding, extras ``[B]``),
    ``"padding_free"`` (the batch's samples in one row) or ``"packed"`` (``PackedRows`` items);
    the last two never leak attention and carry extras per token (``[B, T]``)."""

    def __init__(self, mode: str, pad_token_id: int, attn_implementation: str | None = "sdpa",
                 mask_dtype=None, pad_to_multiple_of: int | None = None):
        from corelooper_lm.collators import DataCollatorForCausalLM
        from corelooper_lm.packing import SegmentCollator

        self.mode = mode
        self.padded = DataCollatorForCausalLM(pad_token_id, pad_to_multiple_of=pad_to_multiple_of)
        self.segments = SegmentCollator(pad_token_id, attn_implementation, mask_dtype, pad_to_multiple_of)

    def __call__(self, items: list) -> dict:
        if self.mode == "padded":
            return self.padded(items)
        rows = [[_segment(p) for p in row] for row in items] if self.mode == "packed" else [
            [_segment(p) for p in items]]
        return self.segments(rows)


def _segment(item: Mapping):
    from corelooper_lm.packing import Segment

    extras = {k: v for k, v in item.items() if k not in ("input_ids", "labels")
              and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return Segment(item["input_ids"], item["labels"], extras)
