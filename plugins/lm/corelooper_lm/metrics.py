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
    """Share of counted tokens whose argmax prediction is the label.

    ``shift=True`` (causal LMs): the logits at position ``t`` predict the label at ``t + 1``, as
    the loss counts them; positions whose (shifted) label is -100 are not counted. Packed batches
    (corelooper_lm.packing: -100 on each segment's first label) count exactly the tokens the same
    samples count unpacked. ``predictions`` may be logits ``[..., vocab]`` or argmax ids.
    State: one float64 tensor ``[correct, counted]``, summed over processes by ``sync``.
    """

    def __init__(self, shift: bool = True, name: str = "accuracy"):
        self.shift, self.name = shift, name
        # causal: only positions whose next label counts are read (the loss provider may then
        # compute the output layer for those alone, a slice at a time)
        self.counted_only = shift
        self.reset()

    @staticmethod
    def preprocess_logits(logits: torch.Tensor) -> torch.Tensor:
        """Each position's argmax: all ``update`` reads of the logits."""
        return logits.argmax(-1)

    def reset(self) -> None:
        self.state = torch.zeros(2, dtype=torch.float64)

    def update(self, predictions, label_ids: torch.Tensor) -> None:
        logits = predictions[0] if isinstance(predictions, (tuple, list)) else predictions
        pred = logits.argmax(-1) if logits.is_floating_point() else logits
        labels = label_ids
        if self.shift:
            pred, labels = pred[..., :-1], labels[..., 1:]
        counted = labels != IGNORE_INDEX
        hits = (pred == labels) & counted
        # no .item(): the device is not synchronised per batch
        batch = torch.stack([hits.sum(), counted.sum()]).to(torch.float64)
        self.state = self.state.to(batch.device) + batch

    def sync(self, reduce_sum) -> None:
        self.state = reduce_sum(self.state)

    def compute(self) -> dict[str, float]:
        correct, counted = self.state.tolist()
        return {self.name: correct / counted if counted else math.nan}
