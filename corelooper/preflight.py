"""Config problems that can be known before the first step, reported before it (not at the first
evaluation, possibly hours in): evaluating with no evaluation data; a ``metric_for_best_model``
that no evaluation can produce. The loop produces ``loss`` (and ``perplexity`` for a causal-LM
loss); any other name must come from ``compute_metrics``, whose names are known only after it
first runs (the first evaluation checks them)."""

from __future__ import annotations

from .errors import ConfigError

LOOP_METRICS = ("loss", "perplexity")


def check_run(args, *, has_eval_data: bool, has_compute_metrics: bool) -> None:
    evaluates = args.eval_strategy != "no"
    if evaluates and not has_eval_data:
        raise ConfigError(
            f"train.eval_strategy = {args.eval_strategy!r}, but there is no evaluation data: set "
            'data.eval (or pass eval_dataset=), or set train.eval_strategy = "no".'
        )
    name = args.metric_for_best_model
    if name is None or not evaluates:
        return
    if name.removeprefix("eval_") not in LOOP_METRICS and not has_compute_metrics:
        raise ConfigError(
            f"train.metric_for_best_model = {name!r}: an evaluation here produces only "
            f"{', '.join('eval_' + m for m in LOOP_METRICS)} (no compute_metrics is set). Use "
            '"loss", or give compute_metrics (Loop(compute_metrics=...) or a plugin) that returns it.'
        )
