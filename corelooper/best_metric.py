"""Best-metric tracking (builtin plugin ``best_metric``): ``metric_for_best_model`` after each
evaluation in training -> ``state.best_metric`` / ``best_global_step`` (and, with
``save_strategy = "best"``, a save). ``load_best_model_at_end`` then loads that checkpoint."""

from __future__ import annotations

import math

from .errors import ConfigError
from .hookspecs import hookimpl


@hookimpl(tryfirst=True)  # before loggers and early stopping, which may read state.best_*
def on_evaluate(loop, state, control, metrics) -> None:
    a = loop.args
    if a.metric_for_best_model is None or not loop.is_training:
        return
    name = a.metric_for_best_model
    key = name if name.startswith("eval_") else f"eval_{name}"
    if key not in metrics:
        raise ConfigError(
            f"train.metric_for_best_model = {name!r}, but the evaluation returned only "
            f"{sorted(metrics)}. Use one of those names."
        )
    value = float(metrics[key])
    if math.isnan(value):
        return
    best = state.best_metric
    if best is None or (value > best if a.greater_is_better else value < best):
        state.best_metric, state.best_global_step = value, state.global_step
        if a.save_strategy == "best":
            control.should_save = True
