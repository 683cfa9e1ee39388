"""corelooper-early-stopping: stop training when an evaluation metric stops improving (HF's
``EarlyStoppingCallback``, configured in ``[early_stopping]``).

Active only when the config has an ``[early_stopping]`` section (as HF users add the callback
explicitly); ``enabled = false`` keeps the section but switches it off. One ``EarlyStopping``
is made for every run (``corelooper_configure``), so two Loops in one process never share it. Its best value and patience
counter are saved in every checkpoint (``plugins.json``) and restored on resume. Enabled without
evaluations (``train.eval_strategy = "no"``), it fails when the ``Loop`` is built, not hours later.
It decides on every process from the same (already reduced) metrics, so all ranks stop together.
"""

from __future__ import annotations

from typing import Any

from corelooper.errors import ConfigError
from corelooper.metric import greater_for, is_better, metric_key, metric_value

__version__ = "0.2.0"

SECTION = "early_stopping"
DEFAULTS: dict[str, Any] = {
    "enabled": True,
    "metric": "",  # default: train.metric_for_best_model, else "eval_loss"
    "patience": 3,  # evaluations without improvement before stopping
    "threshold": 0.0,  # an improvement must exceed this (absolute) to reset the counter
    "mode": "",  # "min" | "max"; default: corelooper.metric.greater_for (min for a name ending in "loss")
}


def corelooper_config_sections() -> dict[str, dict[str, Any]]:
    return {SECTION: dict(DEFAULTS)}


def corelooper_configure(config, plugins) -> None:
    """A fresh stopper for this run, when the config turns it on."""
    reason = inactive_reason(config)
    if reason:
        plugins.set_inactive(SECTION, reason)
        return
    setting = "early_stopping.metric" if settings(config)["metric"] else "train.metric_for_best_model"
    stopper = EarlyStopping(*resolved(config), setting=setting)
    if config.train.eval_strategy == "no":
        raise ConfigError(
            '[early_stopping] is enabled but train.eval_strategy = "no": it decides from '
            'evaluations, and none would run. Set train.eval_strategy = "steps" (with '
            'train.eval_steps) or "epoch", or remove the [early_stopping] section (or set '
            "early_stopping.enabled = false)."
        )
    plugins.register(stopper, f"{SECTION}.run")
    plugins.register_for_checkpointing(SECTION, stopper)


def settings(config) -> dict[str, Any]:
    return {**DEFAULTS, **config.sections.get(SECTION, {})}


def inactive_reason(config) -> str | None:
    """Why this plugin does nothing for ``config`` (``None``: it is active)."""
    if SECTION not in config.sections:
        return "no [early_stopping] section"
    if not settings(config)["enabled"]:
        return "[early_stopping] enabled = false"
    return None


def resolved(config) -> tuple[str, str, int, float]:
    """(metric key, mode, patience, threshold), or a ConfigError naming the key to fix."""
    cfg, train = settings(config), config.train
    metric = metric_key(cfg["metric"] or train.metric_for_best_model or "loss")
    mode = cfg["mode"] or ("max" if greater_for(metric, train) else "min")
    if mode not in ("min", "max"):
        raise ConfigError(f'early_stopping.mode must be "min" or "max", got {mode!r}.')
    if cfg["patience"] < 1:
        raise ConfigError(f"early_stopping.patience must be >= 1, got {cfg['patience']}.")
    if cfg["threshold"] < 0:
        raise ConfigError(f"early_stopping.threshold must be >= 0, got {cfg['threshold']}.")
    return metric, mode, int(cfg["patience"]), float(cfg["threshold"])


class EarlyStopping:
    """One run's stopper: its best value and patience counter are checkpointed."""

    def __init__(self, metric: str, mode: str, patience: int, threshold: float, setting: str) -> None:
        self.metric, self.mode, self.patience, self.threshold = metric, mode, patience, threshold
        self.setting = setting  # the key to name when the metric is missing
        self.best: float | None = None
        self.bad_evals = 0  # evaluations since the last improvement
        self.stopped_at: int | None = None  # global_step at which it stopped training

    # -- checkpoint state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state.get("best")
        self.bad_evals = int(state.get("bad_evals", 0))

    # -- events ----------------------------------------------------------------------------------
    def on_train_begin(self, state) -> None:
        if state.global_step == 0:  # a fresh start: forget evaluations made before train()
            self.best, self.bad_evals, self.stopped_at = None, 0, None

    def on_evaluate(self, loop, state, control, metrics) -> None:
        if not loop.is_training:
            return  # an evaluation outside train() does not count (as HF)
        value = metric_value(metrics, self.metric, self.setting)
        improved = is_better(value, self.best, self.mode == "max", self.threshold)
        if improved:
            self.best, self.bad_evals = value, 0
        else:
            self.bad_evals += 1
        if self.bad_evals >= self.patience:
            control.should_training_stop = True
            self.stopped_at = state.global_step
            if state.is_world_process_zero:
                print(
                    f"early stopping at step {state.global_step}: {self.metric} has not improved on "
                    f"{self.best} for {self.bad_evals} evaluations (patience {self.patience})",
                    flush=True,
                )
