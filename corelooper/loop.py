"""The training loop: ``Loop.train()`` decides *what happens when*.

Hooks decide *what is computed* (providers: ``training_step``, ``compute_loss``,
``evaluation_loop``, ...) and *who is told* (events); the backend decides *how it runs* on the
hardware. The step itself is ``corelooper.step.default_training_step``; evaluation is
``corelooper.evaluation.run_evaluation``; checkpoints are ``corelooper.checkpoints.checkpoint``.

The public Loop API a plugin may use: ``config``, ``args`` (``[train]``), ``state``,
``control``, ``plugins`` (the run's registry), ``hook``, ``events.fire``, ``model``,
``optimizer``, ``scheduler``, ``backend``, ``train_dataset``/``eval_dataset``,
``data_collator``, ``train_loader``, ``loss_type``, ``is_training``, ``num_micro_batches``,
``forward_signature``, ``log()``, ``evaluate()``, ``predict()``, ``training_step()``,
``prepare_for_evaluation()``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from .build import build_collator, build_dataset, build_model
from .checkpoints import checkpoint, elastic
from .checkpoints import loop_side as loop_checkpoints
from .checkpoints.lock import RunLock
from .config import Config, TrainArgs, as_config, resolve_interval
from .data.columns import forward_signature
from .data.loader import batch_rows, count_input_tokens, pad_token_id_of
from .errors import CorelooperError, DataError, explain_failure
from .events import Events
from .gradients import clear_gradients
from .guard import NonFiniteGuard
from .hf.model_options import apply_model_options
from .logwindow import LogWindow, TokensSeen, run_summary
from .plugins import load_plugins
from .preflight import check_run
from .seeding import set_seed
from .state import Control, LoopState


class Loop:
    """Train, evaluate and predict with a model; every part can be changed by plugins.

    ``Loop(model, config, train_dataset=..., eval_dataset=..., plugins=[...])``, or
    ``Loop(config=Config.load("config.toml"))`` to build model and data from the config.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        config: Config | TrainArgs | dict | None = None,
        *,
        train_dataset=None,
        eval_dataset=None,
        data_collator: Callable | None = None,
        compute_metrics: Callable | None = None,
        plugins: Iterable[Any] = (),
        blocked_plugins: Iterable[str] = (),
    ):
        self.plugins = load_plugins(as_config(config), objects=plugins, blocked=blocked_plugins)
        self.config = self.plugins.config  # validated, with the plugins' section defaults
        self.args = self.config.train
        self.hook = self.plugins.hook
        set_seed(self.args.seed)  # before the model is built: same init every run
        self.model = model if model is not None else build_model(self.plugins, self.config)
        self.train_dataset = train_dataset if train_dataset is not None else build_dataset(
            self.plugins, self.config, "train")
        self.eval_dataset = eval_dataset if eval_dataset is not None else build_dataset(
            self.plugins, self.config, "eval")
        self.data_collator = data_collator or build_collator(self.config)
        self.compute_metrics_fn = compute_metrics
        self.state, self.control = LoopState(), Control()
        self.events = Events(self.plugins, loop=self, state=self.state, control=self.control)
        self.optimizer = self.scheduler = self.train_loader = None
        self.loss_type = self.args.loss_type
        self.is_training = False
        self.grad_norm = None  # of the last step (logged with its window)
        self.learning_rate = None  # the rate the last optimizer step used (logged with its window)
        self.num_micro_batches = 0  # of the current step (a step provider may cut them finer)
        self.forward_signature = None
        self._eval_prepared = False
        # As HF's Trainer creates its Accelerator: the distributed facts are known to plugins
        # from on_init_end on.
        self.backend = self._provide("create_backend")
        s = self.state
        s.world_size = self.backend.num_processes
        s.is_world_process_zero = self.backend.is_main_process
        s.is_local_process_zero = self.backend.is_local_main_process
        self.log_window = LogWindow(self.backend.device)
        self.tokens_seen = TokensSeen("no", None, "input_ids")  # set up by train()
        self.guard = NonFiniteGuard(self.args.on_nonfinite, self.args.max_skipped_steps,
                                    deferred=self.backend.device.type != "cpu",
                                    on_cpu=self.backend.device.type == "cpu")
        self.events.fire("on_init_end")

    # -- set-up ------------------------------------------------------------------------------------
    def _setup_train(self):
        if self.train_dataset is None:
            raise CorelooperError("No training data: pass train_dataset= or set data.train.")
        loader = self._provide("train_dataloader", dataset=self.train_dataset)
        self.train_loader = loader  # its state_dict() (streaming data) goes into checkpoints
        self._plan_steps(loader)
        self.model = apply_model_options(self, self.model)
        optimizer = self._provide("create_optimizer", model=self.model)
        self.scheduler = self._provide("create_scheduler", optimizer=optimizer,
                                       num_training_steps=self.state.max_steps)
        self.model, self.optimizer = self.backend.prepare(self.model, optimizer)
        self.forward_signature = forward_signature(self.backend.unwrap_model(self.model))
        self.tokens_seen = TokensSeen(self.args.tokens_seen_mode, pad_token_id_of(self.data_collator),
                                      getattr(self.backend.unwrap_model(self.model), "main_input_name", "input_ids"))
        return loader

    def _plan_steps(self, loader) -> None:
        """Steps per epoch, total steps and epochs, from the loader's length and ``[train]``."""
        a, s = self.args, self.state
        try:
            batches_per_epoch = len(loader)
        except TypeError:
            batches_per_epoch = 0
        if batches_per_epoch == 0 and a.max_steps <= 0:
            raise DataError(
                "The training data has no length (or is empty): set train.max_steps, or give a "
                "dataset with samples."
            )
        self._batches_per_epoch = batches_per_epoch  # the logged epoch counts micro-batches (HF)
        s.steps_per_epoch = math.ceil(batches_per_epoch / a.gradient_accumulation_steps)
        s.max_steps = a.max_steps if a.max_steps > 0 else math.ceil(a.num_train_epochs * s.steps_per_epoch)
        s.num_train_epochs = math.ceil(s.max_steps / s.steps_per_epoch) if s.steps_per_epoch else 1
        s.logging_steps = resolve_interval(a.logging_steps, s.max_steps)  # a float < 1: a ratio (HF)
        s.save_steps = resolve_interval(a.save_steps, s.max_steps)
        s.eval_steps = resolve_interval(a.eval_steps or a.logging_steps, s.max_steps)
        s.train_batch_size = a.per_device_train_batch_size
        s.gradient_accumulation_steps = a.gradient_accumulation_steps

    def prepare_for_evaluation(self) -> None:
        """Before ``evaluate()``/``predict()`` without ``train()``: let the backend wrap the model
        (FSDP / DeepSpeed shard it) and read its ``forward`` signature."""
        if self.optimizer is None and not self._eval_prepared:
            self.model = self.backend.prepare_model(self.model)
            self._eval_prepared = True
        if self.forward_signature is None:
            self.forward_signature = forward_signature(self.backend.unwrap_model(self.model))

    # -- training ----------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | Path | None = None) -> LoopState:
        """Train for ``max_steps`` or ``num_train_epochs``; returns the final ``LoopState``.

        ``resume_from_checkpoint``: a checkpoint folder, ``"latest"`` for the newest complete
        one in ``output_dir``, or ``"auto"``: the newest one if there is one, else start fresh.
        """
        a = self.args
        self.is_training = True
        lock = None
        try:
            set_seed(a.seed)
            output_dir = Path(a.output_dir)
            resume = resume_from_checkpoint or a.resume_from_checkpoint
            resume_dir = checkpoint.resolve(resume, output_dir) if resume else None  # "auto": maybe None
            if resume_dir is not None:  # saved on another world size: keep its global batch
                elastic.prepare_resume(self, resume_dir)
            loader = self._setup_train()
            check_run(a, has_eval_data=self.eval_dataset is not None, has_compute_metrics=(
                self.compute_metrics_fn is not None or self.plugins.implemented_by_others("compute_metrics")))
            if self.backend.is_main_process:  # one run per output_dir, for the run's life
                lock = RunLock.acquire(output_dir)
            if resume_dir is not None:  # first: a bad checkpoint fails before output_dir is changed
                loop_checkpoints.resume(self, resume_dir)
                if self.state.global_step >= self.state.max_steps:
                    return self.state  # a finished run: nothing to do, nothing written
            if self.backend.is_main_process:
                checkpoint.prepare_output_dir(output_dir, self.config, resuming=resume_dir is not None,
                                              overwrite=a.overwrite_output_dir)
            clear_gradients(self.model)  # as HF: gradients left by earlier work are not the first step's
            self.events.fire("on_train_begin")
            if a.eval_on_start:  # as HF: once, before the first step (also on resume)
                self.evaluate()
            self._train_epochs(loader)
            self.is_training = False
            self.events.fire("on_train_end")
        except BaseException as exc:
            raise self._failed(exc) from exc
        finally:
            self.is_training = False
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
        if self.log_window.steps:
            self._log_window()
        self.guard.poll(self, wait=True)
        runtime = time.perf_counter() - started
        summary = run_summary(s.log_history, runtime, s.global_step - steps_before,
                              s.total_samples_seen - samples_before)
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
            self.num_micro_batches = len(micro_batches)
            self.events.fire("on_step_begin")
            step_loss, self.grad_norm = self.training_step(micro_batches)
            self._count_step(epoch, micro_batches, step_loss)
            self.events.fire("on_step_end")
            self._log_evaluate_save()
            if control.should_epoch_stop or control.should_training_stop:
                break

    def training_step(self, micro_batches: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step (the ``training_step`` provider): ``(loss, grad_norm)`` on the device."""
        return self._provide("training_step", micro_batches=micro_batches)

    def _provide(self, hook: str, **kwargs):  # through the dispatcher: checked, its plugin named
        return self.plugins.call_provider(hook, loop=self, **kwargs)[0]

    def _next_micro_batches(self, batches, n: int) -> list:
        try:
            return list(islice(batches, n))
        except CorelooperError:
            raise
        except Exception as e:
            raise DataError(
                f"Loading a training batch failed at global_step {self.state.global_step}: "
                f"{type(e).__name__}: {e}. Check the dataset ({self.config.data.train or 'train_dataset'}) "
                f"and the collator ({self.config.data.collator or 'default'})."
            ) from e

    def _count_step(self, epoch: int, micro_batches: list, step_loss: torch.Tensor) -> None:
        s = self.state
        s.global_step += 1
        s.step_in_epoch += 1
        s.micro_batches_in_epoch += len(micro_batches)
        # As HF: micro-batches done / micro-batches per epoch (5 an epoch, GA 2: 0.4, 0.8, 1.0)
        s.epoch = epoch + (s.micro_batches_in_epoch / self._batches_per_epoch if s.steps_per_epoch else 0)
        samples = sum(batch_rows(b) for b in micro_batches) * s.world_size
        tokens = sum(count_input_tokens(b) for b in micro_batches) * s.world_size
        s.total_samples_seen += samples
        self.log_window.add(step_loss, samples, tokens, self.guard.skipped_total)
        self.tokens_seen.add(micro_batches)

    # -- logging, evaluation, saving -----------------------------------------------------------------
    def _log_evaluate_save(self) -> None:
        control = self.control
        if control.should_log and self.log_window.steps:
            self._log_window()
        control.should_log = False
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

    def _log_window(self) -> None:
        self.tokens_seen.flush(self.backend, self.state)
        lr = self.learning_rate if self.learning_rate is not None else self.scheduler.get_last_lr()[0]
        logs = self.log_window.logs(self.backend, self.grad_norm, lr, self.state.epoch)
        if self.guard.skipped_total:
            logs["skipped_steps"] = self.guard.skipped_total
        self.log(logs)
        self.log_window.reset()

    def log(self, logs: dict) -> None:
        """Record ``logs`` at the current step (``log_history``) and fire ``on_log``."""
        if self.tokens_seen.logged or (self.args.tokens_seen_mode != "no" and self.state.num_input_tokens_seen):
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
        with self._reported("Evaluation"):
            metrics, _, _ = self._provide("evaluation_loop", dataset=dataset,
                                          metric_key_prefix=metric_key_prefix, keep_outputs=False)
            # As HF: the metrics are logged (on_log, rank 0) before on_evaluate, which fires on
            # every process: early stopping must decide the same on all ranks.
            self.tokens_seen.flush(self.backend, self.state)
            self.log({**metrics, "epoch": round(self.state.epoch, 4)})
            self.events.fire("on_evaluate", metrics=metrics)
        return metrics

    def predict(self, test_dataset, metric_key_prefix: str = "test"):
        """Model outputs for every sample, in dataset order: ``(predictions, label_ids, metrics)``."""
        with self._reported("Prediction"):
            metrics, preds, labels = self._provide("evaluation_loop", dataset=test_dataset,
                                                   metric_key_prefix=metric_key_prefix, keep_outputs=True)
            self.events.fire("on_predict", metrics=metrics)
        return preds, labels, metrics

    # -- errors --------------------------------------------------------------------------------------
    def _failed(self, exc: BaseException, action: str = "Training") -> BaseException:
        """``on_exception``, then the error naming its plugin and hook (or the model)."""
        try:
            self.events.fire("on_exception", exception=exc)
        except Exception:  # a broken cleanup hook must not hide the original error
            pass
        return explain_failure(exc, self.plugins, self.state.global_step, self.args.output_dir, action)

    @contextmanager
    def _reported(self, action: str):  # evaluate()/predict() called alone report as train() does
        try:
            yield
        except BaseException as exc:
            if self.is_training:  # train() reports it
                raise
            raise self._failed(exc, action) from exc

    def close(self) -> None:  # the Loop ends (also `with Loop(...)`): corelooper_unconfigure, once
        self.plugins.unconfigure()

    def __enter__(self) -> Loop:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
