"""The last decoder layer over the trained positions only (with ``[lm] head = "trained"``).

The loss reads the final hidden states of the trained positions only (``trained_head.py``), and
only the last decoder layer's output at those positions reaches them. That layer's keys and values
need every position (a trained position attends to the prompt before it), but its queries, the
attention output, the output projection, the MLP and the norms act on each position alone. So for
one forward the layer's ``forward`` is swapped for one that computes keys and values over every
position and the rest over the trained positions, and returns them as one ``[1, n, hidden]`` row:
the rows the head would have gathered. On a small model that is a large share of the work (hidden
256, 2 layers, vocabulary 2,048: the last layer's query and output projections and MLP are ~31% of
a position's matmuls); on a 28-layer model a few percent.

It computes what the layer computes only for the layer it understands: a pre-norm Llama-family
layer (Llama, Mistral, Qwen2, Qwen3: ``input_layernorm``, ``self_attn`` with ``q/k/v/o_proj`` and
optional ``q_norm``/``k_norm``, ``post_attention_layernorm``, ``mlp``) with ``sdpa`` or the
segment-wise sdpa, and no sliding window. Per call it runs the layer's own forward instead where
the numbers would differ: dropout active in the layer (attention dropout, LoRA dropout: another
number of draws would change the random stream), or gradient checkpointing (the recomputation runs
after this forward, with the layer's own ``forward``). The first trimmed forward of a layer is also
checked against the layer's own output on the same inputs (no grad); where they differ, trimming
stops for that layer and ``TrimState.reason`` says why.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .segment_attention import SEGMENT_SDPA, segment_bounds
from .trained_head import swapped_forward, unwrapped

LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj"}
PER_HEAD_NORMS = {"q_norm", "k_norm"}
STATE = "_corelooper_trim_state"


@dataclass
class Kept:
    """The kept positions: per row on the host (the attention's segments), flat on the device."""

    rows: list[list[int]]
    index: torch.Tensor  # positions in the flattened [rows * positions], row-major

    @classmethod
    def of(cls, keep: torch.Tensor) -> Kept:
        host = keep.cpu()  # the one host read of a trimmed forward
        flat = host.flatten().nonzero().flatten()
        return cls(
            [row.nonzero().flatten().tolist() for row in host], flat.to(keep.device, non_blocking=True)
        )

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s kept positions (``[rows, positions, ...]`` -> ``[n, ...]``), no host sync."""
        return tensor.reshape(-1, *tensor.shape[2:]).index_select(0, self.index)


@dataclass
class TrimState:
    """Per layer: whether its first trimmed output matched its own (None: not checked yet)."""

    checked: bool | None = None
    reason: str | None = None


def last_decoder_layer(model) -> torch.nn.Module | None:
    inner = unwrapped(model)
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    return layers[-1] if isinstance(layers, torch.nn.ModuleList) and len(layers) else None


def why_not_trimmable(model) -> str | None:
    """None when the last decoder layer can run over the trained positions; else the reason."""
    layer = last_decoder_layer(model)
    if layer is None:
        return "no decoder layers (get_decoder().layers)"
    parts = {name for name, _ in layer.named_children()}
    if parts != LAYER_PARTS:
        return (
            f"its last layer ({type(layer).__name__}) has parts {sorted(parts)}, not a Llama-family layer's"
        )
    attn = layer.self_attn
    names = {name for name, _ in attn.named_children()}
    if not PROJECTIONS <= names or names - PROJECTIONS - PER_HEAD_NORMS or len(names & PER_HEAD_NORMS) == 1:
        return f"its attention ({type(attn).__name__}) has parts {sorted(names)}, not q/k/v/o projections"
    if getattr(attn, "sliding_window", None) or _sliding(getattr(unwrapped(model), "config", None)):
        return "its last layer uses sliding-window attention"
    impl = getattr(getattr(unwrapped(model), "config", None), "_attn_implementation", None)
    if impl not in ("sdpa", SEGMENT_SDPA):
        return f"its attention is {impl!r} (trimmed only with 'sdpa')"
    if not callable(getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)):
        return f"{type(attn).__module__} has no apply_rotary_pos_emb"
    return None


def _sliding(config) -> bool:
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return kinds[-1] == "sliding_attention"
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True)


def _exact_now(layer) -> bool:
    """Whether a trimmed forward now gives the layer's numbers (no dropout draws, no recompute)."""
    if not layer.training:
        return True
    if getattr(layer, "gradient_checkpointing", False):
        return False
    if getattr(layer.self_attn, "attention_dropout", 0.0):
        return False
    return not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in layer.modules())


@contextmanager
def trimmed_last_layer(model, keep: torch.Tensor):
    """Within the block, the model's last decoder layer returns ``[1, n, hidden]``: its output at
    the ``n`` positions where ``keep`` (``[rows, positions]``) is true, in row-major order. Yields
    a list that holds ``True`` once a forward returned the kept rows only (else the layer ran whole)."""
    trimmed: list[bool] = []
    layer = last_decoder_layer(model) if why_not_trimmable(model) is None else None
    state = getattr(layer, STATE, None) if layer is not None else None
    if layer is None or (state is not None and state.reason) or not _exact_now(layer):
        yield trimmed
        return
    if state is None:
        state = TrimState()
        object.__setattr__(layer, STATE, state)  # not a Module attribute: no state_dict entry
    own_forward = layer.forward

    def forward(hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        def whole():
            return own_forward(
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
                **kwargs,
            )

        if hidden_states.shape[:-1] != keep.shape or position_embeddings is None:
            return whole()
        kept = Kept.of(keep)
        if not len(kept.index):
            return whole()
        out = trimmed_forward(
            layer,
            hidden_states,
            kept,
            attention_mask,
            position_ids,
            position_embeddings,
            kwargs.get("cu_seq_lens_q"),
        )
        if not state.checked and not _matches(state, out, whole, keep):
            return whole()
        trimmed.append(True)
        return out

    with swapped_forward(layer, forward):
        yield trimmed


def _matches(state: TrimState, out: torch.Tensor, whole, keep) -> bool:
    """Compares the first trimmed output with the layer's own (no grad); records the outcome."""
    with torch.no_grad():
        own = whole()
        own = (own[0] if isinstance(own, tuple) else own)[keep]
    got = out[0].detach()
    # the rounding of the dtype the matmuls ran in: another number of rows may round otherwise
    dtype = (
        torch.get_autocast_dtype(got.device.type) if torch.is_autocast_enabled(got.device.type) else got.dtype
    )
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 2 * torch.finfo(dtype).eps
    if got.shape == own.shape and torch.allclose(got.float(), own.float(), rtol=tol, atol=tol / 10):
        state.checked = True
        return True
    diff = (got.float() - own.float()).abs().max().item() if got.shape == own.shape else got.shape
    state.reason = f"its trimmed output differs from its own (max difference {diff})"
    logging.getLogger("corelooper.lm").warning(
        "corelooper-lm: the model's last decoder layer runs over every position from now on: %s. The loss "
        "is unchanged (the layer's own forward); this layer is not the Llama-family one it looks like.",
        state.reason,
    )
    return False


def trimmed_forward(
    layer, hidden_states, kept: Kept, attention_mask, position_ids, position_embeddings, cu_seq_lens=None
) -> torch.Tensor:
    """A Llama-family layer's output at the kept positions: ``[1, n, hidden]``."""
    attn = layer.self_attn
    rows, length, _ = hidden_states.shape
    # the submodules in the layer's own order (ZeRO-3 prefetches parameters by the recorded order)
    normed = layer.input_layernorm(hidden_states)
    query = attn.q_proj(kept.take(normed))  # [n, hidden]: the kept rows in row-major order
    query = query.view(query.shape[0], -1, attn.head_dim)
    per_head_norms = hasattr(attn, "q_norm")  # Qwen3: a norm per head before the rotary embedding
    query = attn.q_norm(query) if per_head_norms else query
    key = attn.k_proj(normed).view(rows, length, -1, attn.head_dim)
    key = (attn.k_norm(key) if per_head_norms else key).transpose(1, 2)
    value = attn.v_proj(normed).view(rows, length, -1, attn.head_dim).transpose(1, 2)
    rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb  # the model's own
    cos, sin = (t.expand(rows, *t.shape[1:]) for t in position_embeddings)
    key = rope(key, key, cos, sin)[0]
    query = query.transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
    query = rope(query, query, kept.take(cos).unsqueeze(0), kept.take(sin).unsqueeze(0))[0]
    attended = _kept_attention(attn, query, key, value, kept.rows, attention_mask, position_ids, cu_seq_lens)
    hidden = kept.take(hidden_states) + attn.o_proj(attended.reshape(attended.shape[0], -1))
    hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return hidden.unsqueeze(0)


def _kept_attention(
    attn, query, key, value, kept_rows: list[list[int]], attention_mask, position_ids, cu_seq_lens
) -> torch.Tensor:
    """``sdpa`` for the kept queries (``[1, heads, n, d]``) over the keys they would see in the
    full layer; ``[n, heads, d]``. One call per segment (per row with a 4-D mask), as the layer's
    own attention does; a kept query at position ``t`` of its segment sees keys ``0..t``."""
    rows, length = key.shape[0], key.shape[2]
    if attention_mask is not None:
        bounds = [[0, length] for _ in range(rows)]
    else:
        cu = cu_seq_lens if rows == 1 and cu_seq_lens is not None and int(cu_seq_lens[-1]) <= length else None
        bounds = segment_bounds(cu, position_ids, rows, length)
    segments = _segments(kept_rows, bounds)
    queries = iter(query.split([len(kept) for row in segments for kept in row if kept], dim=2))
    key_rows, value_rows = (t.split(1, dim=0) if rows > 1 else (t,) for t in (key, value))
    out = []
    for r, row_segments in enumerate(segments):
        sizes = [end - start for start, end in zip(bounds[r], bounds[r][1:], strict=False)]
        # split, not slices: one backward op writes every piece's gradient (segment_attention.py)
        pieces = zip(
            key_rows[r].split(sizes, dim=2),
            value_rows[r].split(sizes, dim=2),
            bounds[r],
            row_segments,
            strict=False,
        )
        for k, v, start, kept in pieces:
            if kept:
                out.append(_attend(attn, next(queries), k, v, kept, start, attention_mask, r))
    return torch.cat(out, dim=0) if len(out) > 1 else out[0]


def _attend(attn, query, key, value, kept: list[int], start: int, attention_mask, row: int) -> torch.Tensor:
    """One segment's kept queries over its keys: ``[n_kept, heads, d]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    length = key.shape[2]
    local = torch.tensor(kept, device=key.device) - start
    if attention_mask is not None:  # padded rows: the layer's own mask, the kept queries' rows of it
        mask, is_causal = attention_mask[min(row, attention_mask.shape[0] - 1), :, local][None], None
    elif len(kept) == length:  # every position kept: the layer's own causal call
        mask, is_causal = None, True
    else:  # a kept query at position t of its segment sees the keys 0..t
        mask, is_causal = (
            (torch.arange(length, device=key.device)[None, :] <= local[:, None])[None, None],
            None,
        )
    return sdpa_attention_forward(
        attn, query, key, value, mask, dropout=0.0, scaling=attn.scaling, is_causal=is_causal
    )[0].squeeze(0)  # a view: select's backward would copy


def _segments(kept_rows: list[list[int]], bounds: list[list[int]]) -> list[list[list[int]]]:
    """Per row, per segment (``bounds``: the row's segment starts closed by its length), the kept
    positions in it (possibly none)."""
    out = []
    for kept, starts in zip(kept_rows, bounds, strict=True):
        row, i = [], 0
        for end in starts[1:]:
            j = i
            while j < len(kept) and kept[j] < end:
                j += 1
            row.append(kept[i:j])
            i = j
        out.append(row)
    return out
