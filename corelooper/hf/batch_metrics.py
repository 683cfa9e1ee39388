"""HF's ``batch_eval_metrics``: ``compute_metrics(eval_pred, compute_result)`` called per batch as
``Trainer.evaluation_loop`` (transformers 5.x) does, ``compute_result=True`` on the last batch (its
return value is the metrics). One batch is held back: the last is known when the loader ends."""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

from ..errors import ConfigError


class EvalPrediction(NamedTuple):  # as HF's: eval_pred.predictions, or ``logits, labels = eval_pred``
    predictions: Any
    label_ids: Any


class HFBatchMetrics:
    """A per-batch metric (``update``/``compute``) around an HF batch-mode ``compute_metrics``."""

    def __init__(self, fn):
        if "compute_result" not in inspect.signature(fn).parameters:
            raise ConfigError(
                "train.batch_eval_metrics = true calls compute_metrics(eval_pred, compute_result=...) once per "
                f"batch, as HF does, but {getattr(fn, '__qualname__', fn)!r} takes no compute_result argument. "
                "Add it (return the metrics when it is True), or set train.batch_eval_metrics = false."
            )
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
