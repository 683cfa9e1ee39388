"""Streaming evaluation metrics (corelooper's ``eval_metric`` contract): per batch ``update``,
``sync(reduce_sum)`` across processes, ``compute`` at the end; no logits are kept.

``Loop(compute_metrics=TokenAccuracy())`` (or a plugin's ``eval_metric`` returning one) replaces
HF's usual ``compute_metrics`` + ``preprocess_logits_for_metrics`` argmax, which keeps every
batch's predictions until the end of ``evaluate()``.
"""

from __future__ import annotations

import math

import torch

IGNORE_INDEX = -100


class TokenAccuracy:
    """Share of counted tokens whose argmax prediction is the label; with ``entropy=True`` also the
    mean over the same tokens of the predicted distribution's entropy in nats (``"entropy"``, TRL's
    ``entropy``); ``accuracy=False`` leaves the accuracy out.

    ``shift=True`` (causal LMs): the logits at position ``t`` predict the label at ``t + 1``, as
    the loss counts them; positions whose (shifted) label is -100 are not counted. Packed batches
    (corelooper_lm.packing: -100 on each segment's first label) count exactly the tokens the same
    samples count unpacked. ``predictions`` may be logits ``[..., vocab]``, argmax ids (accuracy
    only), or what ``preprocess_logits`` returns.
    State: one float64 tensor ``[correct, counted, entropy]``, summed over processes by ``sync``.
    """

    def __init__(
        self, shift: bool = True, name: str = "accuracy", entropy: bool = False, accuracy: bool = True
    ):
        self.shift, self.name, self.entropy, self.accuracy = shift, name, entropy, accuracy
        # causal: only positions whose next label counts are read (the loss provider may then
        # compute the output layer for those alone, a slice at a time)
        self.counted_only = shift
        self.reset()

    def preprocess_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Each position's argmax (all ``update`` reads of the logits); with ``entropy``, float64
        ``[..., 2]``: the argmax (exact: ids < 2**53) and the entropy."""
        from .accuracy import argmax, entropy  # argmax: torch's indices, faster on the CPU

        if not self.entropy:
            return argmax(logits)
        return torch.stack([argmax(logits).to(torch.float64), entropy(logits).to(torch.float64)], dim=-1)

    def reset(self) -> None:
        self.state = torch.zeros(3, dtype=torch.float64)

    def update(self, predictions, label_ids: torch.Tensor) -> None:
        pred, ent = self._predictions(
            predictions[0] if isinstance(predictions, (tuple, list)) else predictions
        )
        labels = label_ids
        if self.shift:
            pred, labels = pred[..., :-1], labels[..., 1:]
            ent = ent[..., :-1] if ent is not None else None
        counted = labels != IGNORE_INDEX
        hits = (pred == labels) & counted
        summed = (
            torch.where(counted, ent, 0.0).sum(dtype=torch.float64)
            if ent is not None
            else torch.zeros((), dtype=torch.float64, device=labels.device)
        )
        # no .item(): the device is not synchronised per batch
        batch = torch.stack(
            [hits.sum().to(torch.float64), counted.sum().to(torch.float64), summed.to(torch.float64)]
        )
        self.state = self.state.to(batch.device) + batch

    def _predictions(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(argmax ids, entropies or None) from logits, ids, or ``preprocess_logits``' answer."""
        if self.entropy and logits.dtype == torch.float64 and logits.shape[-1] == 2:  # preprocess_logits'
            return logits[..., 0], logits[..., 1]
        if logits.is_floating_point():
            from .accuracy import argmax, entropy

            return argmax(logits), (entropy(logits) if self.entropy else None)
        if self.entropy:
            raise ValueError(
                "TokenAccuracy(entropy=True) needs the logits (or its preprocess_logits' answer), "
                "not argmax ids: the entropy is computed from the predicted distribution."
            )
        return logits, None

    def sync(self, reduce_sum) -> None:
        self.state = reduce_sum(self.state)

    def compute(self) -> dict[str, float]:
        correct, counted, summed = self.state.tolist()
        out = {self.name: correct / counted if counted else math.nan} if self.accuracy else {}
        if self.entropy:
            out["entropy"] = summed / counted if counted else math.nan
        return out
