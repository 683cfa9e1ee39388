"""Which metric a run watches, and which way is better: one rule for the whole project.

The Hugging Face Trainer's rules, used by best-model tracking, ``reduce_lr_on_plateau``, early
stopping and hyper-parameter search alike:

- ``metric_for_best_model = "accuracy"`` names ``eval_accuracy`` (the prefix is added unless the
  name already carries it), as ``Trainer._determine_best_metric`` does;
- ``greater_is_better`` defaults to ``False`` when the name ends with ``loss`` and to ``True``
  otherwise, as ``TrainingArguments.__post_init__`` does;
- a value is better when it beats the best so far in that direction (strictly, by more than a
  threshold); the first value always is, a NaN never is.

Pure Python on purpose: the config and the CLI import it without torch.
"""

from __future__ import annotations

import math
from typing import Any


def metric_key(name: str, prefix: str = "eval") -> str:
    """``accuracy`` -> ``eval_accuracy``; ``eval_accuracy`` stays as it is."""
    return name if name.startswith(f"{prefix}_") else f"{prefix}_{name}"


def greater_is_better(name: str, explicit: bool | None = None) -> bool:
    """``explicit`` when it is set, else ``False`` for a ``*loss`` metric and ``True`` otherwise."""
    if explicit is not None:
        return bool(explicit)
    return not name.endswith("loss")


def greater_for(metric: str, args: Any, prefix: str = "eval") -> bool:
    """The direction of ``metric`` for a run with ``TrainArgs`` ``args``.

    ``train.greater_is_better`` describes ``train.metric_for_best_model`` only: it applies when
    ``metric`` is that metric (with or without the prefix), otherwise the name decides. Early
    stopping and HPO watching another metric than the best-model one must not inherit its
    direction.
    """
    best = getattr(args, "metric_for_best_model", None)
    same = best is not None and metric_key(best, prefix) == metric_key(metric, prefix)
    return greater_is_better(metric, getattr(args, "greater_is_better", None) if same else None)


def is_better(value: float, best: float | None, greater: bool, threshold: float = 0.0) -> bool:
    """Whether ``value`` improves on ``best`` by more than ``threshold`` in direction ``greater``."""
    if math.isnan(value):
        return False
    if best is None:
        return True
    return (value - best if greater else best - value) > threshold


def metric_value(metrics: dict[str, Any], name: str, setting: str, prefix: str = "eval") -> float:
    """The value of metric ``name`` in ``metrics``, or a ConfigError naming ``setting`` to fix.

    ``setting`` is the config key that chose the metric (``train.metric_for_best_model``,
    a plugin section's ``metric``, ...), so the message says which line of the config to change.
    """
    key = metric_key(name, prefix)
    if key not in metrics:
        from .errors import ConfigError

        raise ConfigError(
            f"{setting} = {name!r} watches {key!r}, but the evaluation returned only "
            f"{sorted(metrics)}. Set {setting} to one of those names (with or without the "
            f"{prefix}_ prefix)."
        )
    return float(metrics[key])
