"""The training loop: ``Loop.train()`` decides *what happens when*.

Hooks decide *what is computed* (providers) and *who is told* (events); the backend decides *how
it runs*. The step is ``corelooper.step.default_training_step``, evaluation
``corelooper.evaluation.run_evaluation``, set-up ``corelooper.assemble``. The public Loop API is
the read-only properties below and the public methods (docs/hooks.md, "The public Loop API"): a
plugin changes the model or data through the transform hooks, the run through ``control``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from itertools import islice
from operator import attrgetter
from pathlib import Path
from typing import Any

import torch

from . import assemble, blocking, transforms
from .assemble import Resume, batch_error, count_step, failure, plan_steps, reported, resume_directory
from .build import build_collator, build_dataset, build_model
from .checkpoints import checkpoint
from .checkpoints import loop_side as loop_checkpoints
from .checkpoints.lock import RunLock
from .config import Config, TrainArgs, as_config
from .data.columns import forward_signature
from .data.loader import pad_token_id_of, resolve_loss_type
from .errors import CorelooperError
from .events import Events
from .gradients import clear_gradients
from .guard import NonFiniteGuard
from .hf.model_options import apply_model_options
from .logwindow import LogWindow, TokensSeen, run_summary
from .plugins import load_plugins
from .preflight import check_run
from .seeding import set_seed
from .state import Control, LoopState
from .step import StepResult, as_step_result


def _public(name: str, doc: str) -> property:
    """A read-only attribute of the public Loop API; the Loop itself sets ``_name``."""
    return property(attrgetter("_" + name), doc=doc)


class Loop:
    """Train, evaluate and predict with a model; every part can be changed by plugins.

    ``Loop(model, config, train_dataset=..., eval_dataset=..., plugins=[...])``, or
    ``Loop(config=Config.load("config.toml"))`` to build model and data from the config.
    """

    config = _public(
        "config", "The run's validated Config: final before corelooper_configure, never replaced."
    )
    args = _public("args", "``config.train``: the HF TrainingArguments names.")
    plugins = _public("plugins", "The run's plugin registry (corelooper.plugins.Plugins).")
    hook = _public("hook", "``plugins.hook``: call a hook by name.")
    state, control = _public("state", "The LoopState."), _public("control", "The Control flags.")
    events = _public("events", "``events.fire(name, **kwargs)``: fire an event.")
    model = _public("model", "The model: transformed, then wrapped by the backend in train().")
    optimizer, scheduler = (
        _public("optimizer", "None before train()."),
        _public("scheduler", "Its LR schedule."),
    )
    backend = _public("backend", "The backend (None while transform_model runs).")
    train_dataset, eval_dataset = (
        _public("train_dataset", "After transform_data."),
        _public("eval_dataset", "Too."),
    )
    data_collator = _public("data_collator", "The collator, after transform_data.")
    train_loader = _public("train_loader", "This run's training loader (None before train()).")
    loss_type = _public("loss_type", "train.loss_type; 'auto' until resolve_loss_type() sees a batch.")
    is_training = _public("is_training", "True inside train().")
    num_micro_batches = _public("num_micro_batches", "Micro-batches fetched for the step in progress.")
    last_step = _public("last_step", "The StepResult of the last optimizer step (None before).")
    forward_signature = _public("forward_signature", "What the model's forward() accepts.")
    compute_metrics_fn = _public("compute_metrics_fn", "Loop(compute_metrics=...).")
    log_window, tokens_seen = _public("log_window", "Logging window."), _public("tokens_seen", "Token count.")
    guard = _public("guard", "The non-finite guard (train.on_nonfinite).")

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        config: Config | TrainArgs | dict | None = None,
        *,
        train_dataset=None,
        eval_dataset=None,
        data_collator: Callable | None = None,
        compute_metrics: Callable | Any | None = None,  # a function, or a per-batch metric (eval_metric)
        plugins: Iterable[Any] = (),
        blocked_plugins: Iterable[str] = (),
    ):
        resume = Resume(train_dataset)  # its batch geometry is settled before plugins are configured
        with blocking(blocked_plugins):  # never imported, not even for the [train] names they answer to
            self._plugins = load_plugins(as_config(config), plugins, blocked_plugins, settle=resume.settle)
        self._config = self._plugins.config  # validated, with the plugins' section defaults; final
        self._args, self._hook, self._resume_dir = self._config.train, self._plugins.hook, resume.directory
        with assemble.blamed(self._plugins, " while the Loop was built"):  # create_backend, on_init_end, ...
            set_seed(self._args.seed)  # before the model is built: same init every run
            self._model = model if model is not None else build_model(self._plugins, self._config)
            data = {
                "train_dataset": resume.dataset(self._config),
                "eval_dataset": eval_dataset
                if eval_dataset is not None
                else build_dataset(self._plugins, self._config, "eval"),
                "data_collator": data_collator or build_collator(self._config),
            }
            self._train_dataset, self._eval_dataset, self._data_collator = data.values()
            self._compute_metrics_fn = compute_metrics
            self._state, self._control = LoopState(), Control()
            self._events = Events(self._plugins, loop=self, state=self._state, control=self._control)
            self._optimizer = self._scheduler = self._train_loader = self._backend = self._last_step = None
            self._loss_type, self._is_training, self._num_micro_batches = self._args.loss_type, False, 0
            # _learning_rate: the rate the last applied optimizer step used (a skipped step applies none)
            self._learning_rate, self._forward_signature, self._eval_prepared = None, None, False
            # As TRL wraps a PEFT model before the Trainer creates its Accelerator.
            self._model = transforms.transform_model(self._plugins, self, self._model)
            # As HF's Trainer creates its Accelerator: the distributed facts are known from here on.
            self._backend = assemble.create_backend(self)
            resume.check_world_size(self._backend)
            s, b = self._state, self._backend
            s.world_size, s.is_world_process_zero, s.is_local_process_zero = (
                b.num_processes,
                b.is_main_process,
                b.is_local_main_process,
            )
            data = transforms.transform_data(self._plugins, self, self._model, data)  # before any loader
            self._train_dataset, self._eval_dataset, self._data_collator = (
                data[k] for k in transforms.DATA_PARTS
            )
            self._log_window = LogWindow(self._backend.device)
            self._tokens_seen = TokensSeen("no", None, "input_ids")  # set up by train()
            on_cpu = self._backend.device.type == "cpu"
            self._guard = NonFiniteGuard(
                self._args.on_nonfinite, self._args.max_skipped_steps, deferred=not on_cpu, on_cpu=on_cpu
            )
            self._events.fire("on_init_end")

    # -- set-up ----------------------------------------------------------------------------------
    def _setup_train(self):
        if self.train_dataset is None:
            raise CorelooperError("No training data: pass train_dataset= or set data.train.")
        loader = self._provide("train_dataloader", dataset=self.train_dataset)
        self._train_loader = loader  # its state_dict(), if any, goes into checkpoints
        self._batches_per_epoch = plan_steps(self.args, self.state, loader)
        self._model = apply_model_options(self, self.model)
        optimizer = self._provide("create_optimizer", model=self.model)
        self._scheduler = self._provide(
            "create_scheduler", optimizer=optimizer, num_training_steps=self.state.max_steps
        )
        self._model, self._optimizer = self.backend.prepare(self.model, optimizer)
        self._forward_signature = forward_signature(self.backend.unwrap_model(self.model))
        self._tokens_seen = TokensSeen(
            self.args.tokens_seen_mode,
            pad_token_id_of(self.data_collator),
            getattr(self.backend.unwrap_model(self.model), "main_input_name", "input_ids"),
        )
        return loader

    def prepare_for_evaluation(self) -> None:
        """Before ``evaluate()``/``predict()`` without ``train()``: let the backend wrap the model
        (FSDP / DeepSpeed shard it) and read its ``forward`` signature."""
        if self.optimizer is None and not self._eval_prepared:
            self._model = self.backend.prepare_model(self.model)
            self._eval_prepared = True
        if self.forward_signature is None:
            self._forward_signature = forward_signature(self.backend.unwrap_model(self.model))

    def resolve_loss_type(self, batch) -> str:
        """``train.loss_type``; ``"auto"`` is decided once, from the first batch that asks
        (``corelooper.data.loader.resolve_loss_type``), and kept for the run."""
        if self._loss_type == "auto":
            self._loss_type = resolve_loss_type(batch)
        return self._loss_type

    # -- training ----------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | Path | None = None) -> LoopState:
        """Train for ``max_steps`` or ``num_train_epochs``; returns the final ``LoopState``.

        Resumes from ``train.resume_from_checkpoint`` (settled when the Loop was built), or from
        ``resume_from_checkpoint``: a checkpoint folder, ``"latest"`` for the newest complete
        one in ``output_dir``, or ``"auto"``: the newest one if there is one, else start fresh
        (either returns at once when the run already finished this plan: ``finished_run``).
        A checkpoint saved on another number of processes needs another batch geometry: pass it
        in the config (``train.resume_from_checkpoint``), which is final once plugins are set up.
        """
        a = self.args
        self._is_training = True
        lock = None
        try:
            set_seed(a.seed)
            output_dir = Path(a.output_dir)
            resume_dir = resume_directory(self, resume_from_checkpoint, self._resume_dir)
            loader = self._setup_train()
            check_run(
                a,
                has_eval_data=self.eval_dataset is not None,
                has_compute_metrics=(
                    self.compute_metrics_fn is not None
                    or self.plugins.implemented_by_others("compute_metrics")
                    or self.plugins.implemented_by_others("eval_metric")
                ),
            )
            if self.backend.is_main_process:  # one run per output_dir, for the run's life
                lock = RunLock.acquire(output_dir)
            if loop_checkpoints.finished_run(self, resume_from_checkpoint, resume_dir):
                return self.state  # nothing to do, nothing written (no checkpoint loaded: no plugin reacts)
            if resume_dir is not None:  # first: a bad checkpoint fails before output_dir is changed
                loop_checkpoints.resume(self, resume_dir)
                if self.state.global_step >= self.state.max_steps:
                    return self.state  # a finished run: nothing to do, nothing written
            if self.backend.is_main_process:
                checkpoint.prepare_output_dir(
                    output_dir, self.config, resuming=resume_dir is not None, overwrite=a.overwrite_output_dir
                )
            clear_gradients(self.model)  # as HF: gradients left by earlier work are not the first step's
            self.events.fire("on_train_begin")
            if a.eval_on_start:  # as HF: once, before the first step (also on resume)
                self.evaluate()
            self._train_epochs(loader)
            self._is_training = False
            self.events.fire("on_train_end")
        except BaseException as exc:
            raise failure(self, exc) from exc
        finally:
            self._is_training = False
            if lock is not None:  # after on_train_end: loggers still write into output_dir there
                lock.release()
        return self.state

    def _train_epochs(self, loader) -> None:
        s, control = self.state, self.control
        start_epoch = round(s.epoch - s.step_in_epoch / s.steps_per_epoch) if s.steps_per_epoch else 0
        self.model.train()
        started, steps_before, samples_before = time.perf_counter(), s.global_step, s.total_samples_seen
        for epoch in range(start_epoch, s.num_train_epochs):
            if s.global_step >= s.max_steps:
                break
            self._train_epoch(loader, epoch)
            if s.preempted:
                return  # the epoch did not end: its checkpoint must resume mid-epoch; no final model
            if not (control.should_training_stop and s.step_in_epoch < s.steps_per_epoch):
                s.step_in_epoch, s.micro_batches_in_epoch = 0, 0  # kept when stopped mid-epoch
            s.epoch = float(epoch + 1) if not control.should_training_stop else s.epoch
            control.should_epoch_stop = False
            self.events.fire("on_epoch_end")
            self._log_evaluate_save()
            if control.should_training_stop:
                break
        self.guard.poll(self, wait=True)
        runtime = time.perf_counter() - started
        history = s.log_history
        if self.log_window.steps:  # a window the flow did not log (HF's drops the last): train_loss counts it
            pending = self.log_window.logs(self.backend, None, 0.0, s.epoch)
            history = [
                *history,
                {**pending, "skipped_steps": self.guard.skipped_total, "step": s.global_step},
            ]
        summary = run_summary(
            history, runtime, s.global_step - steps_before, s.total_samples_seen - samples_before
        )
        loop_checkpoints.finish(self)
        self.tokens_seen.flush(self.backend, self.state)
        self.log({**summary, "epoch": round(s.epoch, 4)})  # HF's run summary log has it too

    def _train_epoch(self, loader, epoch: int) -> None:
        s, control = self.state, self.control
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        if s.micro_batches_in_epoch and hasattr(loader, "skip") and not self.args.ignore_data_skip:
            loader.skip(s.micro_batches_in_epoch)
        batches = iter(loader)
        self.events.fire("on_epoch_begin")
        while s.global_step < s.max_steps:
            micro_batches = self._next_micro_batches(batches, self.args.gradient_accumulation_steps)
            if not micro_batches:
                break
            self._num_micro_batches = len(micro_batches)
            self.events.fire("on_step_begin")
            self._last_step = step = self.training_step(micro_batches)
            if step.learning_rate is not None:  # a skipped step applied none: keep the last one
                self._learning_rate = step.learning_rate
            count_step(self, epoch, micro_batches, step.loss, self._batches_per_epoch)
            self.events.fire("on_step_end")
            self._log_evaluate_save()
            if control.should_epoch_stop or control.should_training_stop:
                break

    def training_step(self, micro_batches: list) -> StepResult:
        """One optimizer step (the ``training_step`` provider), as a ``StepResult`` (a
        provider's ``(loss, grad_norm)`` tuple is accepted)."""
        return as_step_result(self._provide("training_step", micro_batches=micro_batches), len(micro_batches))

    def _provide(self, hook: str, **kwargs):  # through the dispatcher: checked, its plugin named
        return self.plugins.call_provider(hook, loop=self, **kwargs)[0]

    def _next_micro_batches(self, batches, n: int) -> list:
        try:
            micro_batches = list(islice(batches, n))
        except CorelooperError:
            raise
        except Exception as e:
            raise batch_error(e, self.state.global_step, self.config, self.data_collator) from e
        for batch in micro_batches:  # nothing to call when no plugin implements it
            self.events.fire("on_batch_fetched", batch=batch)
        return micro_batches

    # -- logging, evaluation, saving -----------------------------------------------------------------
    def _log_evaluate_save(self) -> None:
        control = self.control
        if control.should_log and self.log_window.steps:
            self._log_logging_window()
        control.should_log = False
        paused = time.perf_counter()  # evaluating and saving are not the logging window's training time
        if control.should_evaluate:
            control.should_evaluate = False
            self.guard.poll(self, wait=True)
            metrics = self.evaluate()
            if hasattr(self.scheduler, "step_on_metrics"):  # reduce_lr_on_plateau, on every rank
                self.scheduler.step_on_metrics(metrics)
        if control.should_save:
            control.should_save = False
            self.guard.poll(self, wait=True)
            self.tokens_seen.flush(self.backend, self.state)
            loop_checkpoints.save(self)
        self.log_window.start += time.perf_counter() - paused

    def _log_logging_window(self) -> None:
        self.tokens_seen.flush(self.backend, self.state)
        lr = self._learning_rate if self._learning_rate is not None else self.scheduler.get_last_lr()[0]
        grad_norm = self.last_step.grad_norm if self.last_step is not None else None
        logs = self.log_window.logs(self.backend, grad_norm, lr, self.state.epoch)
        if self.guard.skipped_total:
            logs["skipped_steps"] = self.guard.skipped_total
        self.log(logs)
        self.log_window.reset()

    def log(self, logs: dict) -> None:
        """Record ``logs`` at the current step (``log_history``) and fire ``on_log``."""
        if self.tokens_seen.logged or (
            self.args.tokens_seen_mode != "no" and self.state.num_input_tokens_seen
        ):
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen  # (all processes)
        entry = {**logs, "step": self.state.global_step}
        self.state.log_history.append(entry)
        self.control.should_log = False
        if self.state.is_world_process_zero:
            self.events.fire("on_log", logs=logs)
            entry.update(logs)  # keys a (tryfirst) on_log plugin added, e.g. DPO reward margins

    # -- evaluation and prediction -------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Loss over the whole evaluation set (token-weighted) and ``compute_metrics``."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise CorelooperError("No evaluation data: pass eval_dataset= or set data.eval.")
        with reported(self, "Evaluation"):
            self.events.fire("on_evaluate_begin", metric_key_prefix=metric_key_prefix)
            metrics, _, _ = self._provide(
                "evaluation_loop", dataset=dataset, metric_key_prefix=metric_key_prefix, keep_outputs=False
            )
            # As HF: the metrics are logged (on_log, rank 0) before on_evaluate, which fires on
            # every process: early stopping must decide the same on all ranks.
            self.tokens_seen.flush(self.backend, self.state)
            self.log({**metrics, "epoch": round(self.state.epoch, 4)})
            self.events.fire("on_evaluate", metrics=metrics)
        return metrics

    def predict(self, test_dataset, metric_key_prefix: str = "test"):
        """Model outputs for every sample, in dataset order: ``(predictions, label_ids, metrics)``."""
        with reported(self, "Prediction"):
            self.events.fire("on_evaluate_begin", metric_key_prefix=metric_key_prefix)
            metrics, preds, labels = self._provide(
                "evaluation_loop",
                dataset=test_dataset,
                metric_key_prefix=metric_key_prefix,
                keep_outputs=True,
            )
            self.events.fire("on_predict", metrics=metrics)
        return preds, labels, metrics

    # -- errors --------------------------------------------------------------------------------------
    def close(self) -> None:  # the Loop ends (also `with Loop(...)`): corelooper_unconfigure, once
        self.plugins.unconfigure()

    def __enter__(self) -> Loop:
        return self

    __exit__ = lambda self, *exc_info: self.close()  # noqa: E731
