"""The study behind ``corelooper hpo``: one ``Loop`` per trial, each in its own output folder.

- Search space, ``[optuna.space]``: keys are config paths (``train.learning_rate``,
  ``model.args.hidden``); a list is a categorical choice, ``{ low, high }`` a range (int when both
  bounds are ints, float otherwise; ``log = true``, ``step = ...`` as in Optuna).
- Trial ``n`` trains in ``<train.output_dir>/trial-<n>`` (its resolved config.toml, metrics.jsonl,
  checkpoints); its value is the watched metric at its last evaluation.
- The study lives in SQLite (``<train.output_dir>/optuna.db`` unless ``optuna.storage`` says
  otherwise): running the command again resumes it, and ``--trials`` counts every finished
  (complete or pruned) trial, so ``--trials 20`` after 12 runs 8 more.
- The best trial is printed with a table of all trials and written to ``best_trial.json``.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corelooper.config import Config
from corelooper.errors import ConfigError
from corelooper.metric import greater_for, metric_key

from . import DEFAULTS, SECTION, TrialReporter


def settings(config: Config) -> dict[str, Any]:
    if SECTION not in config.sections:
        raise ConfigError(
            f"`corelooper hpo` needs an [optuna] section with a search space in {config.source or 'the config'}, "
            'e.g.\n[optuna.space]\n"train.learning_rate" = { low = 1e-4, high = 1e-2, log = true }'
        )
    s = {**DEFAULTS, **config.sections[SECTION]}
    unknown = set(s) - set(DEFAULTS)
    if unknown:
        raise ConfigError(f"Unknown key(s) in [optuna]: {sorted(unknown)}. Known: {sorted(DEFAULTS)}.")
    if not s["space"]:
        raise ConfigError("[optuna.space] is empty: give at least one parameter to search.")
    return s


def watched(config: Config, s: dict) -> tuple[str, str]:
    """(metric key, direction)."""
    t = config.train
    name = s["metric"] or t.metric_for_best_model or "loss"
    key = metric_key(name)
    direction = s["direction"] or ("maximize" if greater_for(key, t) else "minimize")
    if direction not in ("minimize", "maximize"):
        raise ConfigError(f'optuna.direction must be "minimize" or "maximize", got {direction!r}.')
    return key, direction


class _Check:
    """Stands in for a trial to validate the whole space before the study starts."""

    def suggest_categorical(self, name, choices):
        if not choices:
            raise ConfigError(f"optuna.space.{name!r}: the list of choices is empty.")
        return choices[0]

    def suggest_int(self, name, low, high, **kw):
        return self.suggest_float(name, low, high, **kw)

    def suggest_float(self, name, low, high, log=False, step=None):
        if not low <= high or (log and low <= 0):
            raise ConfigError(f"optuna.space.{name!r}: need low <= high (and low > 0 with log = true).")
        return low


def suggest(trial, space: dict[str, Any]) -> dict[str, Any]:
    params = {}
    for path, spec in space.items():
        if "." not in path:
            raise ConfigError(f"optuna.space: {path!r} must be a config path like 'train.learning_rate'.")
        if isinstance(spec, list):
            params[path] = trial.suggest_categorical(path, spec)
        elif isinstance(spec, dict) and "low" in spec and "high" in spec:
            extra = {k: v for k, v in spec.items() if k not in ("low", "high")}
            bad = set(extra) - {"log", "step"}
            if bad:
                raise ConfigError(f"optuna.space.{path!r}: unknown option(s) {sorted(bad)}; use log, step.")
            ints = all(isinstance(spec[k], int) and not isinstance(spec[k], bool) for k in ("low", "high"))
            fn = trial.suggest_int if ints else trial.suggest_float
            params[path] = fn(path, spec["low"], spec["high"], **extra)
        else:
            raise ConfigError(
                f"optuna.space.{path!r} = {spec!r}: use a list of choices or a table {{ low, high[, log, step] }}."
            )
    return params


def apply(base: dict, params: dict[str, Any]) -> dict:
    d = copy.deepcopy(base)
    for path, value in params.items():
        node = d
        *parents, last = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(
                    f"optuna.space: {path!r} does not name a config value ({p!r} is not a table)."
                )
        node[last] = value
    return d


def _plain(d: dict) -> dict:
    """A config dict without None values (TOML has no null; None means "default" anyway)."""
    return {k: _plain(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}


def make_study(config: Config, s: dict, direction: str):
    import optuna

    out = Path(config.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    storage = s["storage"] or f"sqlite:///{(out / 'optuna.db').resolve()}"
    sampler = {
        "tpe": lambda: optuna.samplers.TPESampler(seed=s["seed"]),
        "random": lambda: optuna.samplers.RandomSampler(seed=s["seed"]),
    }.get(s["sampler"])
    if sampler is None:
        raise ConfigError(f'optuna.sampler must be "tpe" or "random", got {s["sampler"]!r}.')
    if s["pruner"] == "median":
        pruner = optuna.pruners.MedianPruner(
            n_startup_trials=s["n_startup_trials"], n_warmup_steps=s["n_warmup_steps"]
        )
    elif s["pruner"] == "none":
        pruner = optuna.pruners.NopPruner()
    else:
        raise ConfigError(f'optuna.pruner must be "median" or "none", got {s["pruner"]!r}.')
    name = s["study_name"] or out.resolve().name
    return optuna.create_study(
        study_name=name,
        storage=storage,
        sampler=sampler(),
        pruner=pruner,
        direction=direction,
        load_if_exists=True,
    )


def run_study(
    config: Config, trials: int | None = None, blocked: list[str] = (), echo: Callable[[str], None] = print
):
    """Run (or resume) the study; returns it. Prints the trials table and the best trial."""
    import optuna

    from corelooper.loop import Loop

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "`corelooper hpo` runs its trials in one process; start it with plain `corelooper hpo`, "
            "not under torchrun."
        )
    s = settings(config)
    metric, direction = watched(config, s)
    Config.from_dict(apply(_plain(config.to_dict()), suggest(_Check(), s["space"])), source=config.source)
    total = trials if trials is not None else s["n_trials"]
    if total < 1:
        raise ConfigError(f"--trials must be >= 1, got {total}.")
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # progress is echoed here; errors end the command
    study = make_study(config, s, direction)
    finished = [t for t in study.trials if t.state.is_finished() and t.state != optuna.trial.TrialState.FAIL]
    todo = total - len(finished)
    if not study.trials:
        for params in s["enqueue"]:
            study.enqueue_trial(params)
    base = _plain(config.to_dict())
    out = Path(config.train.output_dir)
    if finished:
        echo(f"resuming study {study.study_name!r}: {len(finished)} trials done, {max(todo, 0)} to run")

    def objective(trial) -> float:
        params = suggest(trial, s["space"])
        d = apply(base, params)
        trial_dir = out / f"trial-{trial.number}"
        d["train"]["output_dir"] = str(trial_dir)
        d["train"]["overwrite_output_dir"] = True
        cfg = Config.from_dict(d, source=config.source)
        reporter = TrialReporter(trial, metric)
        echo(f"trial {trial.number}: " + ", ".join(f"{k}={v!r}" for k, v in params.items()))
        loop = Loop(config=cfg, plugins=[reporter], blocked_plugins=list(blocked))
        loop.train()
        trial.set_user_attr("output_dir", str(trial_dir))
        if reporter.pruned_at is not None:
            echo(
                f"trial {trial.number}: pruned at step {reporter.pruned_at} ({metric} = {reporter.last:.6g})"
            )
            raise optuna.TrialPruned()
        if reporter.last is None:  # no evaluation during training: evaluate the final model
            if loop.eval_dataset is None:
                raise ConfigError(
                    f"optuna watches {metric!r}, but the config has no evaluation data (data.eval)."
                )
            loop.evaluate()
        echo(f"trial {trial.number}: {metric} = {reporter.last:.6g}")
        return reporter.last

    if todo > 0:
        study.optimize(objective, n_trials=todo)
    report(study, metric, out, echo)
    return study


def report(study, metric: str, out: Path, echo: Callable[[str], None]) -> dict | None:
    """The trials table, the best trial, and ``best_trial.json``."""
    import optuna

    names = sorted({k for t in study.trials for k in t.params})
    rows = [["trial", "state", metric, *names]]
    for t in study.trials:
        value = (
            f"{t.value:.6g}"
            if t.value is not None
            else (
                f"{t.intermediate_values[max(t.intermediate_values)]:.6g}*" if t.intermediate_values else "-"
            )
        )
        rows.append([str(t.number), t.state.name.lower(), value, *(_fmt(t.params.get(n)) for n in names)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not complete:
        echo("no complete trial yet (* = last value of a pruned trial)")
        return None
    best = study.best_trial
    trial_dir = best.user_attrs.get("output_dir", str(out / f"trial-{best.number}"))
    summary = {
        "number": best.number,
        "metric": metric,
        "value": best.value,
        "direction": study.direction.name.lower(),
        "params": best.params,
        "output_dir": trial_dir,
        "config": str(Path(trial_dir) / "config.toml"),
        "trials": len(study.trials),
    }
    (out / "best_trial.json").write_text(json.dumps(summary, indent=1) + "\n")
    echo(
        f"best trial {best.number}: {metric} = {best.value:.6g}  ({', '.join(f'{k}={_fmt(v)}' for k, v in best.params.items())})"
    )
    echo(f"  its run: {trial_dir} (config: {summary['config']}); summary in {out / 'best_trial.json'}")
    return summary


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)
