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
from itertools import chain

import numpy as np


def plain(messages) -> list[dict] | None:
    """``messages`` as transformers normalizes them, when every value is a ``str`` or ``None``."""
    out = []
    for m in messages:
        if type(m) is not dict:
            return None
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
    if bool(getattr(backend, "encode_special_tokens", False)) != bool(getattr(tok, "split_special_tokens", False)):
        return None
    return backend


def encode(conversations: list[list[dict]], tok, template: str, masked: bool):
    """``(ids, masks)`` per conversation (``masks`` ``None`` unless ``masked``), or ``None``."""
    backend = _backend(tok)
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        return None
    if backend is None:
        return None
    texts, spans = render_jinja_template(conversations=conversations, chat_template=tok.get_chat_template(template),
                                         return_assistant_tokens_mask=masked, **tok.special_tokens_map)
    encodings = backend.encode_batch(texts, add_special_tokens=False)
    ids = [e.ids for e in encodings]
    if not masked:
        return ids, None
    return ids, [assistant_mask(e.offsets, s) for e, s in zip(encodings, spans, strict=True)]


def assistant_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 where a token's characters overlap a ``{% generation %}`` span: transformers' single pass
    (tokens in order, a span index that only moves forward, stop after the last span) on arrays.
    With span ends in order (as rendering appends them), that pass's span index at each token is
    the running maximum of the first span ending after the token's start."""
    n = len(offsets)
    if not spans or not n:
        return np.zeros(n, dtype=bool)
    off = np.fromiter(chain.from_iterable(offsets), dtype=np.int64, count=2 * n).reshape(n, 2)
    sp = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    if np.any(np.diff(sp[:, 1]) < 0):
        return _mask_loop(offsets, spans)
    idx = np.maximum.accumulate(np.searchsorted(sp[:, 1], off[:, 0], side="right"))
    inside = idx < len(sp)
    out = np.zeros(n, dtype=bool)
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
