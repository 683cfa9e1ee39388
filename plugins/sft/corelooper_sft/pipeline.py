"""Raw rows -> tokenized rows (memory-mapped by ``datasets``) -> over-long policy -> packing,
plus the collator that matches: padded, padding-free, or packed (plugins/lm/corelooper_lm/packing.py)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from corelooper.errors import DataError

from . import eos, formats
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


BATCH = 1000  # rows per batched tokenizer call: the Rust encoder's batch, and datasets' write unit


def tokenize_dataset(
    dataset,
    tokenizer,
    cfg: Mapping[str, Any],
    where: str,
    chat_template: str | None,
    fingerprint: str | None = None,
    limit: Limit | None = None,
    rows_file: str | None = None,
):
    """The rows tokenized and masked, and ``limit`` (max_length) applied, in one ``datasets.map``:
    the rows are written once, to ``rows_file`` when given (a cache entry), else where ``datasets``
    puts a map's output."""
    import datasets

    datasets.disable_progress_bars()
    ds = as_hf_dataset(dataset, where)
    if len(ds) == 0:
        raise DataError(f"{where}: the data set is empty.")
    fn = BatchTokenizer(RowTokenizer(tokenizer, cfg, where, chat_template), limit)
    # With a cache key, datasets neither hashes the tokenizer (slow) nor reuses its own cache file:
    # a rebuild is a rebuild.
    kw = {"new_fingerprint": fingerprint, "load_from_cache_file": False} if fingerprint else {}
    return ds.map(
        fn,
        with_indices=True,
        batched=True,
        batch_size=BATCH,
        remove_columns=ds.column_names,
        cache_file_name=rows_file,
        **kw,
    )


class BatchTokenizer:
    """``datasets.map(batched=True)`` over ``RowTokenizer``: chat rows without tools go through one
    batched render and one Rust ``encode_batch`` (chatbatch.py: ``apply_chat_template``'s ids and
    assistant mask, without its per-token loops), the labels masked on arrays; any other row is
    tokenized on its own.
    Same ids and labels as ``RowTokenizer`` row by row (tests/test_preprocess_scale.py), plus a
    ``trained`` column (labels != -100 after the causal shift) so no later step reads the labels.
    Each batch leaves as an Arrow table (int32 token lists: half the bytes of int64, and a
    vocabulary never needs more), with ``Limit``'s max_length applied."""

    def __init__(self, rows: RowTokenizer, limit: Limit | None = None):
        self.rows, self.limit = rows, limit
        self.said_reserved = False

    def _fast(self, row: Mapping) -> bool:
        r = self.rows
        if "input_ids" in row or "messages" not in row or row.get("tools") or not r.template:
            return False
        return (not r.assistant_only or r.markers) and formats.is_conversation(row["messages"])

    def __call__(self, batch: Mapping[str, list], indices: list[int]):
        out = _as_table(self._tokenized(batch, indices))  # every batch: one schema
        if self.rows.append_eos is not None:
            out = eos.append(out, self.rows.append_eos)
        return out if self.limit is None else self.limit(out)

    def _tokenized(self, batch: Mapping[str, list], indices: list[int]):
        names = list(batch)
        reserved = [n for n in names if n in formats.RESERVED]
        if reserved and not self.said_reserved:
            self.said_reserved = True
            logger.warning(
                "sft: %s: the data's column(s) %s are not used: corelooper-sft computes its own "
                "per-sample %s. Rename them to pass them to the batch.",
                self.rows.where,
                reserved,
                ", ".join(formats.RESERVED),
            )
        rows = [dict(zip(names, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        fast = [k for k, row in enumerate(rows) if self._fast(row)]
        try:
            chats = self._chats([rows[k] for k in fast])
        except Exception:  # a template error: the row path names the row that fails
            fast, chats = [], None
        if chats is not None and len(fast) == len(rows) and chats["trained"].all():
            return _table(chats, [formats.extras(row) for row in rows])  # Arrow: no Python lists
        out: list[dict | None] = [None] * len(rows)
        for k, item in zip(fast, _items(chats) if chats else [], strict=True):
            out[k] = {**item, **formats.extras(rows[k])}
        for k, row in enumerate(rows):
            if out[k] is None or out[k]["trained"] == 0:  # the row path tokenizes, or names the error
                item = self.rows(row, indices[k])
                out[k] = {**item, "trained": _trained(item["labels"])}
        keys = dict.fromkeys(key for item in out for key in item)  # a row without an extra: None
        return {key: [item.get(key) for item in out] for key in keys}

    def _chats(self, rows: list[dict]) -> dict | None:
        """The rows' ids, labels, lengths and trained counts as flat arrays (chatbatch.Encoded)."""
        if not rows:
            return None
        import numpy as np

        from . import chatbatch

        r = self.rows
        masked = r.assistant_only
        convs = [chatbatch.plain(row["messages"]) for row in rows]
        enc = (
            chatbatch.encode(convs, r.tok, r.template, masked) if all(c is not None for c in convs) else None
        )
        if enc is None:  # rich messages or a padding/truncating backend: transformers' own path
            out = r.tok.apply_chat_template(
                [row["messages"] for row in rows],
                chat_template=r.template,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=masked,
            )
            enc = chatbatch.Encoded.from_lists(out["input_ids"], out["assistant_masks"] if masked else None)
        labels = np.where(enc.mask, enc.ids, IGNORE) if masked else enc.ids
        trained = labels != IGNORE
        # trained after the causal shift: each row's count without its first token
        sums = np.add.reduceat(trained, np.cumsum(enc.lengths) - enc.lengths) if enc.lengths.all() else None
        if sums is None:  # an empty rendering: counted row by row (the row path then names it)
            sums = np.array([t[1:].sum() if len(t) else 0 for t in enc.split(trained)], dtype=np.int64)
        else:
            sums = sums.astype(np.int64) - trained[np.cumsum(enc.lengths) - enc.lengths]
        return {"enc": enc, "labels": labels, "trained": sums}


def _items(chats: dict) -> list[dict]:
    enc = chats["enc"]
    ids, labels = enc.split(enc.ids), enc.split(chats["labels"])
    return [
        {"input_ids": i.tolist(), "labels": lab.tolist(), "length": len(i), "trained": int(t)}
        for i, lab, t in zip(ids, labels, chats["trained"], strict=True)
    ]


def _table(chats: dict, extras: list[dict]):
    """The batch as an Arrow table (``datasets.map`` writes it as-is): list columns from the flat
    arrays and their offsets, the schema ``_as_table`` gives the Python lists."""
    import numpy as np
    import pyarrow as pa

    enc = chats["enc"]
    offsets = pa.array(np.concatenate([[0], np.cumsum(enc.lengths)]).astype(np.int32))
    cols = {
        "input_ids": pa.ListArray.from_arrays(offsets, pa.array(enc.ids, type=pa.int32())),
        "labels": pa.ListArray.from_arrays(offsets, pa.array(chats["labels"], type=pa.int32())),
        "length": pa.array(enc.lengths),
        "trained": pa.array(chats["trained"]),
    }
    for key in dict.fromkeys(k for e in extras for k in e):  # a row without an extra: None
        cols[key] = pa.array([e.get(key) for e in extras], type=pa.float64())
    return pa.table(cols)


def column(ds, name: str) -> list[int]:
    """One integer column as a list, read as one Arrow array (``ds[name]`` iterates row by row, and
    datasets gathers a filtered data set's rows one by one: one vectorized ``take`` instead)."""
    values = ds.data.column(name)
    indices = getattr(ds, "_indices", None)
    if indices is not None:
        values = values.take(indices.column(0))
    return values.to_numpy().tolist()


def _trained(labels: Sequence[int]) -> int:
    return sum(x != IGNORE for x in labels[1:])


class Limit:
    """``[sft] max_length`` and ``overlong`` on each tokenized batch (inside the tokenizing map, so
    the rows are written once): over-long rows truncated (``_Truncate``; rows then left with no
    trained token dropped) or dropped, counted in ``stats``. ``bfd_split``/``wrapped`` packing and
    ``max_length = 0`` leave rows whole (the packing plan splits over-long samples into pieces)."""

    def __init__(self, cfg: Mapping[str, Any], stats: Stats):
        self.max_length = int(cfg["max_length"] or 0)
        self.drop = cfg["overlong"] == "drop"
        self.cut = _Truncate(self.max_length, cfg["truncation_mode"] == "keep_end")
        self.stats = stats

    @staticmethod
    def needed(cfg: Mapping[str, Any], packing: bool) -> bool:
        return int(cfg["max_length"] or 0) > 0 and not (packing and cfg["packing_strategy"] != "bfd")

    def __call__(self, table):
        import numpy as np
        import pyarrow as pa

        over = table.column("length").to_numpy() > self.max_length
        n = int(over.sum())
        self.stats.overlong += n
        if self.drop:
            self.stats.dropped += n
            return table.filter(pa.array(~over)) if n else table
        if not n:  # the columns a cut batch has: every batch must have the same
            return table.append_column("untruncated_length", table.column("length"))
        table = self.cut(table)
        self.stats.truncated += n
        keep = table.column("trained").to_numpy() > 0
        self.stats.fully_masked_dropped += int(np.count_nonzero(~keep))
        return table if keep.all() else table.filter(pa.array(keep))


FIRST_COLUMNS = ("input_ids", "labels", "length", "trained")


def _as_table(out):
    """``BatchTokenizer``'s batch (an Arrow table, or columns of Python values) as an Arrow table
    with ``_table``'s schema: int32 token lists, int64 counts, float64 extras, in one column order."""
    import pyarrow as pa

    if isinstance(out, pa.Table):
        return out
    types = {
        "input_ids": pa.list_(pa.int32()),
        "labels": pa.list_(pa.int32()),
        "length": pa.int64(),
        "trained": pa.int64(),
    }
    names = [*FIRST_COLUMNS, *(k for k in out if k not in FIRST_COLUMNS)]
    return pa.table({k: pa.array(out[k], type=types.get(k, pa.float64())) for k in names})


class _Truncate:
    """``datasets.map`` on Arrow batches: over-long rows cut to ``max_length`` (their first or last
    tokens) with index arithmetic on the flat token arrays, their ``trained`` recounted; the
    ``untruncated_length`` kept. No row becomes a Python list."""

    def __init__(self, max_length: int, keep_end: bool):
        self.max_length, self.keep_end = max_length, keep_end

    def __call__(self, table):
        import numpy as np
        import pyarrow as pa

        lengths = table.column("length").to_numpy()
        kept = np.minimum(lengths, self.max_length)
        offsets = np.zeros(len(kept) + 1, dtype=np.int64)
        np.cumsum(kept, out=offsets[1:])
        cols = {name: table.column(name) for name in table.column_names}
        flat = {}
        for name in ("input_ids", "labels"):
            arr = table.column(name).combine_chunks()
            old = arr.offsets.to_numpy().astype(np.int64)
            first = old[:-1] + (lengths - kept if self.keep_end else 0)  # where each row's kept tokens start
            index = np.repeat(first - offsets[:-1], kept) + np.arange(offsets[-1])
            flat[name] = arr.values.to_numpy()[index]
            cols[name] = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat[name]))
        trained = (flat["labels"] != IGNORE).astype(np.int64)
        counts = np.add.reduceat(trained, offsets[:-1]) - trained[offsets[:-1]] if kept.all() else None
        if counts is None:
            counts = np.array(
                [trained[a + 1 : b].sum() for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
            )
        cols["trained"] = pa.array(
            np.where(lengths > self.max_length, counts, table.column("trained").to_numpy())
        )
        cols["length"] = pa.array(kept)
        cols["untruncated_length"] = table.column("length")
        return pa.table(cols)


class TokenizedRows:
    """Map-style view of tokenized rows: ``{"input_ids", "labels", <numeric extras>}`` per item."""

    def __init__(self, ds, stats: Stats):
        self.stats = stats
        self._lengths = column(ds, "length") if "length" in ds.column_names else None
        self.untruncated = (
            column(ds, "untruncated_length") if "untruncated_length" in ds.column_names else None
        )
        self.ds = ds.remove_columns(
            [c for c in ("length", "untruncated_length", "trained") if c in ds.column_names]
        )

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

    def __init__(self, rows: TokenizedRows, capacity: int, strategy: str, plan: list | None = None):
        from corelooper_lm.packing import plan_packing

        self.rows = rows
        self.stats = rows.stats
        self.plan = plan if plan is not None else plan_packing(rows.lengths, capacity, strategy)

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


def prepare(
    dataset,
    tokenizer,
    cfg: Mapping[str, Any],
    where: str,
    chat_template: str | None = None,
    use_cache: bool = True,
):
    """The data set as the model will see it: ``TokenizedRows`` or, when packing, ``PackedRows``;
    read back from the cache (cache.py) when the data, tokenizer, template and settings are unchanged."""
    from . import cache

    packing = bool(cfg["packing"])
    if packing and not cfg["max_length"]:
        raise DataError("[sft] packing = true needs [sft] max_length > 0: the length of a packed row.")
    source = as_hf_dataset(dataset, where)
    if len(source) == 0:
        raise DataError(f"{where}: the data set is empty.")
    name = (
        cache.key(source, tokenizer, cfg, chat_template) if use_cache and cache.root() is not None else None
    )
    hit = cache.load(name, where) if name else None
    if hit is not None:
        ds, meta = hit
        stats = Stats(where, **meta["stats"])
        stats.lengths = column(ds, "length")
        plan = [[tuple(p) for p in row] for row in meta["plan"]] if meta.get("plan") is not None else None
        logger.info("sft: %s: prepared data read from the cache (%s).", where, name)
    else:
        ds, stats, plan = _prepare(source, tokenizer, cfg, where, chat_template, packing, name)
    sentence = stats.sentence(int(cfg["max_length"] or 0), cfg["overlong"])
    if sentence:
        logger.warning(sentence)
    eos.check(ds, tokenizer, cfg, where)  # samples that train no end-of-turn token: one warning
    rows = TokenizedRows(ds, stats)
    return PackedRows(rows, int(cfg["max_length"]), cfg["packing_strategy"], plan) if packing else rows


def _plan(lengths: list[int], cfg: Mapping[str, Any]) -> list[list[tuple[int, int, int]]]:
    from corelooper_lm.packing import plan_packing

    return plan_packing(lengths, int(cfg["max_length"]), cfg["packing_strategy"])


def _prepare(source, tokenizer, cfg, where: str, chat_template, packing: bool, name: str | None):
    """The cache's miss path: the rows (tokenized, masked, max_length applied), their statistics
    and packing plan; with a cache key the rows are written into a new cache entry."""
    from . import cache

    rows_file = cache.begin(name, where) if name else None
    try:
        ds, stats = _tokenized(source, tokenizer, cfg, where, chat_template, packing, name, rows_file)
    except BaseException as e:
        if rows_file is None:
            raise
        cache.discard(rows_file)
        if not (isinstance(e, OSError) and e.errno in cache.DISK_ERRNOS):
            raise
        cache.not_cached(where, e)  # the cache's disk, full or read-only: the rows where datasets puts them
        rows_file = None
        ds, stats = _tokenized(source, tokenizer, cfg, where, chat_template, packing, name, None)
    plan = _plan(stats.lengths, cfg) if packing else None
    if rows_file is not None:
        meta = {
            "stats": {k: v for k, v in vars(stats).items() if k not in ("where", "lengths")},
            "plan": plan,
            "rows": len(ds),
        }
        stored = cache.store(name, rows_file, meta, where)  # renamed into place: read back from there
        ds = ds if stored is None else stored
    return ds, stats, plan


def _tokenized(source, tokenizer, cfg, where: str, chat_template, packing: bool, name: str | None, rows_file):
    stats = Stats(where, samples=len(source))
    limit = Limit(cfg, stats) if Limit.needed(cfg, packing) else None
    ds = tokenize_dataset(
        source, tokenizer, cfg, where, chat_template, name, limit, str(rows_file) if rows_file else None
    )
    if len(ds) == 0:
        raise DataError(f"{where}: no sample is left after [sft] overlong = {cfg['overlong']!r}.")
    stats.lengths = column(ds, "length")
    stats.tokens = sum(stats.lengths)
    stats.trained_tokens = sum(column(ds, "trained"))
    return ds, stats


class SFTCollator:
    """Batches for ``mode`` ``"padded"`` (HF's usual right padding, extras ``[B]``),
    ``"padding_free"`` (the batch's samples in one row) or ``"packed"`` (``PackedRows`` items);
    the last two never leak attention and carry extras per token (``[B, T]``)."""

    def __init__(
        self,
        mode: str,
        pad_token_id: int,
        attn_implementation: str | None = "sdpa",
        mask_dtype=None,
        pad_to_multiple_of: int | None = None,
    ):
        from corelooper_lm.collators import DataCollatorForCausalLM
        from corelooper_lm.packing import SegmentCollator

        self.mode = mode
        self.padded = DataCollatorForCausalLM(pad_token_id, pad_to_multiple_of=pad_to_multiple_of)
        self.segments = SegmentCollator(pad_token_id, attn_implementation, mask_dtype, pad_to_multiple_of)

    def __call__(self, items: list) -> dict:
        if self.mode == "padded":
            return self.padded(items)
        rows = (
            [[_segment(p) for p in row] for row in items]
            if self.mode == "packed"
            else [[_segment(p) for p in items]]
        )
        return self.segments(rows)


def _segment(item: Mapping):
    from corelooper_lm.packing import Segment

    extras = {
        k: v
        for k, v in item.items()
        if k not in ("input_ids", "labels") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    return Segment(item["input_ids"], item["labels"], extras)
