"""Evaluation with a per-position metric: the output layer a slice of rows at a time.

A metric with ``preprocess_logits`` (``TokenAccuracy``: the argmax) reads each position's logits
alone, and a loss-only evaluation reads none, so an evaluation needs neither the whole ``[positions, vocab]`` logits nor a log-softmax as
large for the loss (the largest arrays of an evaluation; HF's Trainer holds both per batch). For
one forward, the output layer's ``forward`` is swapped for one that runs the layer's own forward
on one slice of rows at a time (``EVAL_CHUNK_BYTES`` of float32 logits), adds the slice's
cross-entropy to the loss and keeps the metric's preprocessing of it. It runs inside the layer's
call, where ZeRO-3 and FSDP have gathered its weights. With ``counted_only`` the rows are the
positions whose causal target counts, and the last decoder layer runs over those only
(``trained_layer``). A padding-free row is run as pieces of whole samples (``row_pieces``), so
the forward's own arrays are a piece's too.

The model's own forward gets the layer's output for one position back as its logits. Whatever it
does to them afterwards (Gemma 2's soft-capping, Cohere's ``logit_scale``) the slices did not do:
a model that returned another tensor than that one (other than the same values upcast) is
evaluated the plain way, and the reason is given.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from corelooper.outputs import PAD, LogitsWanted, Preprocessed

from .trained_head import causal_targets, slice_rows, swapped_forward, unwrapped
from .trained_layer import trimmed_last_layer

# An evaluation forward over a padding-free row runs over pieces of whole samples of at most this
# many positions (row_pieces): its activations are a piece's, however many samples a batch holds.
PIECE_POSITIONS = 1024
# a padding-free batch's segment bounds (corelooper_lm.packing), made anew for each piece
SEGMENT_KEYS = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}


@dataclass
class _Slices:
    """What the swapped output layer computed during one forward."""

    total: torch.Tensor | None = None  # summed cross-entropy of the rows
    predictions: list[torch.Tensor] = field(default_factory=list)
    probe: torch.Tensor | None = None  # what the layer returned to the model
    calls: int = 0


def preprocessed_loss(model, batch, num_items_in_batch, smoothing: float, wanted: LogitsWanted):
    """``(loss, Preprocessed(predictions))`` of ``model`` on ``batch`` in evaluation (``(loss,
    None)`` when ``wanted.preprocess`` is None: a loss-only evaluation), or
    ``(None, reason)`` when the model does something to its logits after the output layer (or
    calls it otherwise than once with the final hidden states): the caller evaluates it whole."""
    targets = causal_targets(batch)
    keep = targets != -100
    record = _Slices()
    for piece, piece_targets in row_pieces(batch, targets):
        reason = _one_forward(model, piece, piece_targets, smoothing, wanted, record)
        if reason:
            return None, reason
    items = keep.sum() if num_items_in_batch is None else num_items_in_batch
    if wanted.preprocess is None:  # a loss-only evaluation
        return record.total / items, None
    rows = torch.cat(record.predictions)
    if wanted.counted_only:
        fill = float("nan") if rows.is_floating_point() else (False if rows.dtype == torch.bool else PAD)
        predictions = rows.new_full((*keep.shape, *rows.shape[1:]), fill)
        predictions[keep] = rows
    else:
        predictions = rows.reshape(*keep.shape, *rows.shape[1:])
    return record.total / items, Preprocessed(predictions)


def _one_forward(
    model, batch, targets, smoothing: float, wanted: LogitsWanted, record: _Slices
) -> str | None:
    """One forward of ``model`` on ``batch``, its output layer in slices (adding to ``record``);
    the reason when the model's logits are not the layer's own."""
    keep = targets != -100
    head = unwrapped(model).get_output_embeddings()
    record.calls, record.probe = 0, None
    trim = trimmed_last_layer(model, keep) if wanted.counted_only else nullcontext([])
    with trim as trimmed, _swapped(head, record, targets, keep, wanted, trimmed, smoothing):
        outputs = model(
            **{k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}, use_cache=False
        )
    return _why_not_own(record, outputs["logits"] if isinstance(outputs, dict) else outputs[0])


def row_pieces(batch, targets) -> list[tuple[dict, torch.Tensor]]:
    """A padding-free batch (one row of whole samples: ``cu_seq_lens_q``, no mask) cut into pieces
    of whole samples of at most ``PIECE_POSITIONS`` positions (a longer sample alone), for a no-grad
    forward each: the forward's own arrays (the MLP's ``[positions, intermediate]``) are then a
    piece's, not the whole row's. Each sample attends to itself only, so every position gets the
    numbers it gets in the row. Any other batch is one piece, itself, as is every batch when
    several processes evaluate."""
    whole = [(batch, targets)]
    cu = batch.get("cu_seq_lens_q")
    ids = batch.get("input_ids")
    if (
        torch.is_grad_enabled()
        or cu is None
        or not torch.is_tensor(ids)
        or ids.dim() != 2
        or ids.shape[0] != 1
        or ids.shape[1] <= PIECE_POSITIONS
        or _several_processes()
    ):
        return whole
    length = ids.shape[1]
    per_position = {k for k, v in batch.items() if torch.is_tensor(v) and v.shape[:2] == (1, length)}
    if any(torch.is_tensor(v) for k, v in batch.items() if k not in per_position | SEGMENT_KEYS):
        return whole  # a mask, or another tensor whose pieces are not known
    bounds = [int(x) for x in cu.tolist()]
    bounds += [length] if bounds[-1] < length else []  # trailing padding: a segment of its own
    cuts, start = [0], 0
    for end in bounds[1:]:
        if end - cuts[-1] > PIECE_POSITIONS and start > cuts[-1]:
            cuts.append(start)
        start = end
    cuts.append(length)
    if len(cuts) == 2:
        return whole
    pieces = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        local = torch.tensor([x - a for x in bounds if a <= x <= b], dtype=cu.dtype, device=cu.device)
        longest = int((local[1:] - local[:-1]).max())
        piece = {k: (v[:, a:b] if k in per_position else v) for k, v in batch.items()}
        piece.update(cu_seq_lens_q=local, cu_seq_lens_k=local, max_length_q=longest, max_length_k=longest)
        pieces.append((piece, targets[:, a:b]))
    return pieces


def _several_processes() -> bool:
    """Whether other processes take part: a sharded model (FSDP, ZeRO-3) gathers its weights in
    every forward, so each process must run as many forwards as the others, whatever its batch."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _why_not_own(record: _Slices, logits) -> str | None:
    if record.calls != 1:
        return f"the model called its output layer {record.calls} time(s) in one forward, not once"
    if record.probe is None:
        return "the model's output layer got other positions than the batch's (logits_to_keep?)"
    if logits is record.probe:
        return None
    if (
        torch.is_tensor(logits)
        and logits.dtype != record.probe.dtype
        and torch.equal(logits, record.probe.to(logits.dtype))
    ):
        return None  # only upcast: the loss upcasts each slice too
    return "the model changes the output layer's logits before returning them (soft-capping, a logit scale)"


@contextmanager
def _swapped(head: torch.nn.Module, record: _Slices, targets, keep, wanted: LogitsWanted, trimmed, smoothing):
    own_forward = head.forward

    def forward(hidden, *args, **kwargs):
        record.calls += 1
        if trimmed:  # the last decoder layer returned the kept positions only: [1, n, hidden]
            rows, row_targets = hidden.reshape(-1, hidden.shape[-1]), targets[keep]
        elif hidden.shape[:-1] == keep.shape:
            rows = hidden[keep] if wanted.counted_only else hidden.reshape(-1, hidden.shape[-1])
            row_targets = targets[keep] if wanted.counted_only else targets.reshape(-1)
        else:  # not the call we understand (record.probe stays None: evaluated whole)
            return own_forward(hidden, *args, **kwargs)
        record.probe = own_forward(hidden.reshape(-1, hidden.shape[-1])[-1:].unsqueeze(0), *args, **kwargs)
        _slices(
            lambda x: own_forward(x, *args, **kwargs),
            rows,
            row_targets.long(),
            wanted.preprocess,
            smoothing,
            record,
        )
        return record.probe

    with swapped_forward(head, forward):
        yield


def _slices(
    layer, rows: torch.Tensor, row_targets: torch.Tensor, preprocess, smoothing: float, record: _Slices
) -> None:
    """The loss and the metric's predictions of ``rows``, the layer over one slice at a time."""
    step = slice_rows(record.probe.shape[-1])
    total = (
        record.total if record.total is not None else torch.zeros((), device=rows.device, dtype=torch.float32)
    )
    for start in range(0, max(len(rows), 1), step):
        logits = layer(rows[start : start + step])
        total = total + F.cross_entropy(
            logits.float(),
            row_targets[start : start + step],
            ignore_index=-100,
            reduction="sum",
            label_smoothing=smoothing,
        )
        if preprocess is not None:
            record.predictions.append(preprocess(logits))
        del logits  # before the next slice's
    record.total = total
