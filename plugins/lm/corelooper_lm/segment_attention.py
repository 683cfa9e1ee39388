"""``sdpa`` one segment at a time: leak-free packing without an O(T^2) mask.

A packed or padding-free row of ``T`` tokens made of segments of ``L_1 .. L_n`` tokens needs each
token to attend to the earlier tokens of its own segment only. With plain ``sdpa`` that takes a
``[B, 1, T, T]`` block-diagonal mask: the kernel computes (and on CPU, for a float mask, reads)
all ``T^2`` scores, most of them masked. This attention runs ``sdpa(is_causal=True)`` on each
segment's slice of the row instead: ``sum(L_i^2)`` scores, no mask to build, the same kernel and
the same numbers as each sample run alone (plugins/lm/tests/test_packing.py). It is what flash-attention's
varlen does on a GPU, for machines and models that have only ``sdpa``.

``use_segment_attention(model)`` registers it with ``transformers``' attention and mask interfaces
(under ``SEGMENT_SDPA``) and switches a model whose attention is ``sdpa`` to it; batches built by
``SegmentCollator(attn_implementation=SEGMENT_SDPA)`` are then one row with ``position_ids`` and
``cu_seq_lens_q/k``, as for flash attention. Batches without ``cu_seq_lens_q`` still work: with a
padding mask (padded evaluation) it is plain ``sdpa``; without one, the segments are read from
``position_ids`` (they restart at 0), as ``transformers`` does for packed rows.
"""

from __future__ import annotations

SEGMENT_SDPA = "corelooper_segment_sdpa"


def segment_bounds(cu_seq_lens=None, position_ids=None, rows: int = 1, length: int = 0) -> list[list[int]]:
    """Per row, the offsets where segments start, closed by the row's length: ``[0, 3, 5]`` for
    segments of 3 and 2 tokens. From ``cu_seq_lens`` (one row) or from ``position_ids`` (a new
    segment wherever the position does not follow the previous one)."""
    if cu_seq_lens is not None:
        bounds = [int(x) for x in cu_seq_lens.tolist()]
        return [bounds + [length]] if bounds[-1] < length else [bounds]  # trailing padding: its own segment
    if position_ids is None:
        return [[0, length] for _ in range(rows)]
    pos = position_ids.expand(rows, -1) if position_ids.shape[0] != rows else position_ids
    out = []
    for row in pos.tolist():
        starts = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1] + 1]
        out.append(starts + [len(row)])
    return out


def segment_sdpa_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """``transformers`` attention-interface function (``query``: ``[B, heads, T, head_dim]``;
    returns ``([B, T, heads, head_dim], None)``, as ``sdpa_attention_forward``)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows, length = query.shape[0], query.shape[2]
    if attention_mask is not None or key.shape[2] != length or length <= 1:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    cu = kwargs.get("cu_seq_lens_q")
    bounds = segment_bounds(
        cu if rows == 1 and cu is not None and int(cu[-1]) <= length else None,
        kwargs.get("position_ids"),
        rows,
        length,
    )
    if all(len(b) == 2 for b in bounds):  # one segment per row: plain causal attention
        return sdpa_attention_forward(
            module, query, key, value, None, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = []
    for r, starts in enumerate(bounds):
        sizes = [b - a for a, b in zip(starts, starts[1:], strict=False) if b > a]
        # split, not slices: its backward writes each piece's gradient into one tensor once,
        # where every slice's backward would fill a whole-row zero tensor
        q, k, v = (t[r : r + 1].split(sizes, dim=2) for t in (query, key, value))
        pieces = [
            sdpa_attention_forward(
                module, qi, ki, vi, None, dropout=dropout, scaling=scaling, is_causal=True
            )[0]
            for qi, ki, vi in zip(q, k, v, strict=True)
        ]
        out.append(torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0])
    return (torch.cat(out, dim=0) if rows > 1 else out[0]), None


def _segment_mask(*args, attention_mask=None, **kwargs):
    """The mask for ``SEGMENT_SDPA``: ``sdpa``'s when there is padding to mask, else none (the
    attention keeps the segments apart itself, so no ``T x T`` mask is built)."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register_segment_attention() -> str:
    """Register ``SEGMENT_SDPA`` with ``transformers`` (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(SEGMENT_SDPA, segment_sdpa_forward)
    AttentionMaskInterface.register(SEGMENT_SDPA, _segment_mask)
    return SEGMENT_SDPA


def use_segment_attention(model) -> str | None:
    """Switch ``model`` (a ``transformers`` model) from ``sdpa`` to ``SEGMENT_SDPA``; returns the
    attention the model uses now (``SEGMENT_SDPA``, or its own when that is not ``sdpa``: flash
    attention separates segments already, ``eager``/others keep the 4-D mask)."""
    config = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None)
    if attn != "sdpa":
        return attn
    register_segment_attention()
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(SEGMENT_SDPA)
    if getattr(config, "_attn_implementation", None) != SEGMENT_SDPA:
        config._attn_implementation = SEGMENT_SDPA
    return SEGMENT_SDPA
