"""``Trainer.hyperparameter_search`` with Optuna (installed with corelooper-optuna), as HF runs it.

Each trial is a fresh drop-in ``Trainer`` of the same class: the model from ``model_init`` (given
the trial when it takes one), ``TrainingArguments`` with the trial's values (cast to the field's
type, as HF casts them) and ``output_dir/run-N`` (HF's trial folder), the same data, collator,
callbacks and functions. The objective is ``compute_objective`` of the trial's last evaluation
during training (reported to Optuna at each, which may prune the trial), or of an evaluation
after training when there was none — HF's rule. Returns HF's ``BestRun``.
"""

from __future__ import annotations

import copy
from typing import Any

from corelooper.errors import ConfigError


def hyperparameter_search(
    trainer,
    hp_space,
    compute_objective,
    n_trials: int,
    direction="minimize",
    backend=None,
    hp_name=None,
    **kwargs,
):
    from transformers.trainer_utils import BestRun, default_compute_objective, default_hp_space_optuna

    optuna = _optuna(backend)
    if trainer.model_init is None:
        raise RuntimeError(
            "To use hyperparameter search, you need to pass your model through a model_init function."
        )
    if trainer.loop.backend.num_processes > 1:
        raise ConfigError(
            "corelooper_hf.Trainer.hyperparameter_search runs its trials in one process: start the script "
            "without a launcher (each trial may still use every device of this machine)."
        )
    hp_space = hp_space or default_hp_space_optuna
    compute_objective = compute_objective or default_compute_objective
    optimize = {k: kwargs.pop(k) for k in ("timeout", "n_jobs", "gc_after_trial", "catch") if k in kwargs}
    directions = direction if isinstance(direction, list) else None
    study = optuna.create_study(direction=None if directions else direction, directions=directions, **kwargs)

    def objective(trial):
        return run_trial(trainer, trial, hp_space(trial), compute_objective, hp_name)

    study.optimize(objective, n_trials=n_trials, **optimize)
    if directions:
        return [BestRun(str(t.number), t.values, t.params) for t in study.best_trials]
    best = study.best_trial
    return BestRun(str(best.number), best.value, best.params)


def _optuna(backend):
    if backend not in (None, "optuna") and str(getattr(backend, "value", backend)) != "optuna":
        raise ConfigError(
            f"hyperparameter_search(backend={backend!r}): corelooper_hf.Trainer searches with Optuna "
            '(backend="optuna"); install it with `pip install corelooper-optuna`.'
        )
    try:
        import optuna
    except ImportError:
        raise ConfigError(
            "hyperparameter_search needs Optuna, which is not installed: `pip install corelooper-optuna`."
        ) from None
    return optuna


def trial_args(args, params: dict[str, Any], run_name: str):
    """``args`` with the trial's values (cast to each field's type, as HF does) and its own folder."""
    args = copy.deepcopy(args)
    for key, value in params.items():
        if not hasattr(args, key):
            raise ConfigError(
                f"The search space names {key!r}, which is not a TrainingArguments field: name a field "
                "(learning_rate, num_train_epochs, per_device_train_batch_size, seed, ...)."
            )
        old = getattr(args, key)
        setattr(args, key, type(old)(value) if old is not None else value)
    args.output_dir = f"{args.output_dir}/{run_name}"
    return args


def run_trial(trainer, trial, params: dict, compute_objective, hp_name) -> float:
    import inspect

    from transformers import TrainerCallback

    optuna = _optuna(None)
    init = trainer.model_init
    takes_trial = len(inspect.signature(init).parameters) == 1
    reported = {}

    class Report(TrainerCallback):
        """HF's _report_to_hp_search: the objective of each evaluation, to Optuna (which may prune)."""

        def on_evaluate(self, args, state, control, metrics=None, **kw):
            reported["objective"] = compute_objective(dict(metrics))
            trial.report(reported["objective"], state.global_step)
            if trial.should_prune():
                reported["pruned"] = True
                control.should_training_stop = True

    added = added_by_the_trainer(trainer.args)  # the new Trainer adds its own again
    callbacks = [cb for cb in trainer.callback_handler.callbacks if type(cb) not in added]
    run = type(trainer)(
        model_init=(lambda: init(trial)) if takes_trial else init,
        args=trial_args(trainer.args, params, hp_name(trial) if hp_name else f"run-{trial.number}"),
        data_collator=trainer.data_collator,
        train_dataset=trainer.train_dataset,
        eval_dataset=trainer.eval_dataset,
        processing_class=trainer.processing_class,
        compute_loss_func=trainer.compute_loss_func,
        compute_metrics=trainer.compute_metrics,
        callbacks=[*callbacks, Report()],
        optimizer_cls_and_kwargs=trainer.optimizer_cls_and_kwargs,
        preprocess_logits_for_metrics=trainer.preprocess_logits_for_metrics,
    )
    run.state.trial_name, run.state.trial_params = trial.number, params
    try:
        run.train()
        if reported.get("pruned"):
            raise optuna.TrialPruned()
        if "objective" not in reported:  # no evaluation during training: one now (HF's rule)
            reported["objective"] = compute_objective(run.evaluate())
    finally:
        run.loop.close()
    return reported["objective"]


def added_by_the_trainer(args) -> set[type]:
    """The callback classes every Trainer adds itself: flow, progress, ``report_to`` integrations."""
    from .trainer import _default_callbacks, _progress_callback

    return {*_default_callbacks(args), _progress_callback(args)}
