"""HF's ``batch_eval_metrics``: ``compute_metrics(eval_pred, compute_result)`` called per batch.

As ``Trainer.evaluation_loop`` (transformers 5.x) does it: every batch's ``EvalPrediction`` goes
to the function with ``compute_result=False`` except the last one, with ``True``, whose return
value is the metrics. The function keeps its own running state, so HF users' code runs unchanged;
one batch is held back (the last one is known only when the loader ends), no other outputs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

from ..errors import ConfigError


class EvalPrediction(NamedTuple):
    """What HF passes: ``eval_pred.predictions`` / ``.label_ids``, or ``logits, labels = eval_pred``."""

    predictions: Any
    label_ids: Any


class HFBatchMetrics:
    """A streaming metric (``update``/``compute``) around an HF batch-mode ``compute_metrics``."""

    def __init__(self, fn: Callable):
        try:
            takes = "compute_result" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            takes = True
        if not takes:
            raise ConfigError(
                "train.batch_eval_metrics = true calls compute_metrics(eval_pred, compute_result=...) once per "
                f"batch, as HF does, but {getattr(fn, '__qualname__', fn)!r} takes no compute_result argument. "
                "Add it (return the metrics when it is True), or set train.batch_eval_metrics = false.")
        self.fn, self.pending = fn, None

    def reset(self) -> None:
        self.pending = None

    def update(self, predictions, label_ids) -> None:
        if self.pending is not None:
            self.fn(self.pending, compute_result=False)
        self.pending = EvalPrediction(predictions, label_ids)

    def compute(self) -> dict:
        last, self.pending = self.pending, None
        return (self.fn(last, compute_result=True) or {}) if last is not None else {}
