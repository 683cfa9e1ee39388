"""Best-metric tracking (builtin plugin ``best_metric``): ``metric_for_best_model`` after each
evaluation in training -> ``state.best_metric`` / ``best_global_step`` (and, with
``save_strategy = "best"``, a save). ``load_best_model_at_end`` then loads that checkpoint."""

from __future__ import annotations

from ..hookspecs import hookimpl
from ..metric import is_better, metric_value


def corelooper_settings():
    """Without this plugin no best checkpoint is known: these settings are refused then."""
    return {
        "train": {
            "save_strategy": lambda value, train: {} if value == "best" else None,
            "load_best_model_at_end": lambda value, train: {} if value else None,
        }
    }


@hookimpl(tryfirst=True)  # before loggers and early stopping, which may read state.best_*
def on_evaluate(loop, state, control, metrics) -> None:
    a = loop.args
    if a.metric_for_best_model is None or not loop.is_training:
        return
    value = metric_value(metrics, a.metric_for_best_model, "train.metric_for_best_model")
    if is_better(value, state.best_metric, bool(a.greater_is_better)):
        state.best_metric, state.best_global_step = value, state.global_step
        if a.save_strategy == "best":
            control.should_save = True
