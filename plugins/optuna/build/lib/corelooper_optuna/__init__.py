"""corelooper-optuna: hyper-parameter search with Optuna, configured in ``[optuna]``.

``corelooper hpo CONFIG --trials N`` runs the study (``corelooper_optuna.search``); the plugin adds
that subcommand through ``corelooper_add_commands``. Otherwise this module only declares the
``[optuna]`` section, so configs that carry one validate (and ``corelooper plugins`` lists its
keys); it changes nothing in ``corelooper run``.
During a study each trial's ``Loop`` gets a ``TrialReporter`` that reports every evaluation to
Optuna and stops the trial when the pruner says so.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.2.0"

SECTION = "optuna"
DEFAULTS: dict[str, Any] = {
    "n_trials": 10,  # total trials of the study (`--trials` overrides)
    "metric": "",  # default: train.metric_for_best_model, else eval_loss
    "direction": "",  # "minimize" | "maximize"; default: corelooper.metric.greater_for (minimize a "...loss")
    "study_name": "",  # default: the name of train.output_dir
    "storage": "",  # default: sqlite:///<train.output_dir>/optuna.db (resumable)
    "sampler": "tpe",  # "tpe" | "random"
    "seed": 0,  # the sampler's seed
    "pruner": "median",  # "median" | "none"
    "n_startup_trials": 2,  # the pruner prunes nothing before this many trials are complete
    "n_warmup_steps": 0,  # ... nor at evaluations before this global step
    "enqueue": [],  # parameter sets to try first, e.g. [{ "train.learning_rate" = 3e-3 }]
    "space": {},  # "section.key" = { low, high[, log, step] } | [choices]
}


def corelooper_config_sections() -> dict[str, dict[str, Any]]:
    return {SECTION: dict(DEFAULTS)}


def corelooper_configure(plugins) -> None:
    # It acts through `corelooper hpo` (which runs each trial as a Loop), never inside a run.
    plugins.set_inactive(SECTION, "used by `corelooper hpo CONFIG`, not by `corelooper run`")


def corelooper_add_commands(app) -> None:
    from .command import add_hpo_command

    add_hpo_command(app)


class TrialReporter:
    """Per-trial plugin: ``on_evaluate`` reports the watched metric; prunes when Optuna says so."""

    name = "optuna_trial"

    def __init__(self, trial, metric: str):
        self.trial = trial
        self.metric = metric
        self.pruned_at: int | None = None
        self.last: float | None = None

    def on_evaluate(self, state, control, metrics: dict) -> None:
        from corelooper.metric import metric_value

        self.last = metric_value(metrics, self.metric, "optuna.metric (or train.metric_for_best_model)")
        self.trial.report(self.last, state.global_step)
        if self.trial.should_prune():
            self.pruned_at = state.global_step
            control.should_training_stop = True
