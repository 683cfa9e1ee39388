"""A batch of plain chat rows -> token ids and the assistant mask, without ``apply_chat_template``'s
per-row overheads: the same ids and mask as ``tok.apply_chat_template(batch, tokenize=True,
return_dict=True, return_assistant_tokens_mask=True)``, cheaper (plugins/sft/tests/test_chatbatch.py).

Where the time went at 100k conversations (benchmarks/README.md): transformers normalizes every
message recursively (objects to dicts, then drops ``None`` values), converts every encoding to
Python lists it then re-reads, and builds the assistant mask with a Python loop over every token.
Here: messages that are already plain ``str`` dicts only lose their ``None`` values (what that
normalization gives them), the same ``render_jinja_template`` renders them with the
``{% generation %}`` character spans, the Rust ``encode_batch`` tokenizes them, and the mask is
the same overlap rule on arrays. Anything else (objects, content parts, a tokenizer whose backend
pads or truncates) returns ``None``: the caller uses ``apply_chat_template``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np


def plain(messages) -> list[dict] | None:
    """``messages`` as transformers normalizes them, when every value is a ``str`` or ``None``
    (a message of strings only is passed as it is: rendering copies what it reads)."""
    out = []
    for m in messages:
        if type(m) is not dict:
            return None
        if all(type(v) is str for v in m.values()):
            out.append(m)
            continue
        item = {}
        for key, value in m.items():
            if type(value) is str:
                item[key] = value
            elif value is not None:
                return None  # content parts, tool calls, objects: transformers' own normalization
        out.append(item)
    return out


def _backend(tok):
    """The Rust tokenizer, when calling it directly gives what ``tok(text, add_special_tokens=False)``
    gives: a fast tokenizer with neither padding nor truncation set on its backend."""
    backend = getattr(tok, "backend_tokenizer", None) if getattr(tok, "is_fast", False) else None
    if backend is None or backend.padding is not None or backend.truncation is not None:
        return None
    if bool(getattr(backend, "encode_special_tokens", False)) != bool(
        getattr(tok, "split_special_tokens", False)
    ):
        return None
    return backend


@dataclass
class Encoded:
    """A batch's conversations one after the other: ``ids`` (and ``mask``) are flat, ``lengths``
    says how many tokens each conversation has (so no per-row Python list is made)."""

    lengths: np.ndarray
    ids: np.ndarray
    mask: np.ndarray | None  # the assistant mask over ``ids``; None when not asked for

    @classmethod
    def from_lists(cls, ids: list[list[int]], masks: list[list[int]] | None) -> Encoded:
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        total = int(lengths.sum())
        flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=total)
        mask = None if masks is None else np.fromiter(chain.from_iterable(masks), dtype=bool, count=total)
        return cls(lengths, flat, mask)

    def split(self, values: np.ndarray) -> list[np.ndarray]:
        return np.split(values, np.cumsum(self.lengths)[:-1]) if len(self.lengths) else []


def encode(conversations: list[list[dict]], tok, template: str, masked: bool) -> Encoded | None:
    """The batch's ids (and assistant mask when ``masked``), or ``None``: use apply_chat_template."""
    backend = _backend(tok)
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        return None
    if backend is None:
        return None
    texts, spans = render_jinja_template(
        conversations=conversations,
        chat_template=tok.get_chat_template(template),
        return_assistant_tokens_mask=masked,
        **tok.special_tokens_map,
    )
    encodings = backend.encode_batch(texts, add_special_tokens=False)
    lengths = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
    total = int(lengths.sum())
    ids = np.fromiter(chain.from_iterable(e.ids for e in encodings), dtype=np.int64, count=total)
    if not masked:
        return Encoded(lengths, ids, None)
    offsets = np.fromiter(
        chain.from_iterable(chain.from_iterable(e.offsets for e in encodings)),
        dtype=np.int64,
        count=2 * total,
    ).reshape(total, 2)
    return Encoded(lengths, ids, batch_mask(offsets, lengths, spans, [len(t) for t in texts]))


def batch_mask(
    offsets: np.ndarray,
    lengths: np.ndarray,
    spans: Sequence[Sequence[tuple[int, int]]],
    text_lengths: Sequence[int],
) -> np.ndarray:
    """``assistant_mask`` of every conversation at once: character positions made global (each
    text after the previous one), so a token never reaches another conversation's span (its end
    is at most its text's end, where the next text's spans begin) and one pass covers the batch."""
    base = np.zeros(len(text_lengths), dtype=np.int64)
    base[1:] = np.cumsum(np.asarray(text_lengths, dtype=np.int64))[:-1]
    counts = np.fromiter(map(len, spans), dtype=np.int64, count=len(spans))
    sp = np.fromiter(
        chain.from_iterable(chain.from_iterable(spans)), dtype=np.int64, count=2 * int(counts.sum())
    ).reshape(-1, 2)
    if len(sp) and np.any(np.diff(sp[:, 1] + np.repeat(base, counts)) < 0):  # ends out of order in a row
        return np.concatenate(
            [np.zeros(0, dtype=bool)]
            + [
                _mask_loop([tuple(x) for x in o], s)
                for o, s in zip(np.split(offsets, np.cumsum(lengths)[:-1]), spans, strict=True)
            ]
        )
    return _mask(offsets + np.repeat(base, lengths)[:, None], sp + np.repeat(base, counts)[:, None])


def assistant_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 where a token's characters overlap a ``{% generation %}`` span, as transformers decides it
    for one conversation (its token ``offsets``, the rendered text's ``spans``)."""
    n = len(offsets)
    off = np.fromiter(chain.from_iterable(offsets), dtype=np.int64, count=2 * n).reshape(n, 2)
    sp = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    if np.any(np.diff(sp[:, 1]) < 0):
        return _mask_loop(offsets, spans)
    return _mask(off, sp)


def _mask(off: np.ndarray, sp: np.ndarray) -> np.ndarray:
    """transformers' single pass (tokens in order, a span index that only moves forward, stop
    after the last span) on arrays: with span ends in order (as rendering appends them), that
    pass's span index at each token is the running maximum of the first span ending after the
    token's start."""
    out = np.zeros(len(off), dtype=bool)
    if not len(sp) or not len(off):
        return out
    idx = np.maximum.accumulate(np.searchsorted(sp[:, 1], off[:, 0], side="right"))
    inside = idx < len(sp)
    out[inside] = off[inside, 1] > sp[idx[inside], 0]
    return out


def _mask_loop(offsets, spans) -> np.ndarray:
    """transformers' loop itself, for span lists out of order."""
    mask = np.zeros(len(offsets), dtype=bool)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        mask[t] = end > spans[k][0]
    return mask
