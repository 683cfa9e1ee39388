"""The training loop. ``Loop.training_step`` is the whole optimizer step, in one screen.

The loop decides *what happens when*; hooks decide *what is computed* (providers) and *who is
told* (events); the backend decides *how it runs* on the hardware.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from . import checkpoint, preemption
from .config import Config, TrainArgs, check_train_args, import_object, resolve_interval
from .data import (
    batch_rows,
    count_input_tokens,
    count_loss_items,
    count_tokens_seen,
    pad_token_id_of,
    resolve_loss_type,
)
from .errors import CorelooperError, DataError, PluginError, TrainingError
from .losses import forward_signature, predictions_of, split_batch
from .plugins import load_plugins
from .preemption import Preemption
from .seeding import set_seed
from .state import Control, LoopState


def as_config(config: Config | TrainArgs | dict | None) -> Config:
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, TrainArgs):
        check_train_args(config)  # as Config.load does: cross-field checks, best-metric defaults
        return Config(train=config)
    if isinstance(config, dict):
        return Config.from_dict(config)
    raise TypeError(f"config must be a Config, TrainArgs or dict, not {type(config).__name__}")


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
        self.config = as_config(config)
        self.args = self.config.train
        self.plugins = load_plugins(self.config, objects=plugins, blocked=blocked_plugins)
        self.config = self.plugins.config  # read-only, with the plugins' section defaults
        self.args = self.config.train
        self.hook = self.plugins.hook
        set_seed(self.args.seed)  # before the model is built: same init every run
        self.model = model if model is not None else self._build_model()
        self.train_dataset = self._dataset(train_dataset, "train")
        self.eval_dataset = self._dataset(eval_dataset, "eval")
        self.data_collator = data_collator or self._collator()
        self.compute_metrics_fn = compute_metrics
        self.state = LoopState()
        self.control = Control()
        self.backend = None
        self.optimizer = None
        self.scheduler = None
        self.loss_type = self.args.loss_type
        self.num_micro_batches = 1
        self._events = {}
        self._setup_backend()  # as HF's Trainer creates its Accelerator: distributed facts known early
        self._fire("on_init_end")

    # -- building from the config ---------------------------------------------------------------
    def _build_model(self) -> torch.nn.Module:
        ref = self.config.model.factory
        if not ref:
            raise CorelooperError("No model: pass one to Loop(model=...) or set model.factory.")
        factory = import_object(ref, "model.factory", self._base())
        try:
            model = factory(**self.config.model.args)
        except Exception as e:
            raise CorelooperError(
                f"model.factory = {ref!r} raised {type(e).__name__}: {e} (called with "
                f"model.args = {self.config.model.args!r})."
            ) from e
        if not isinstance(model, torch.nn.Module):
            raise CorelooperError(
                f"model.factory = {ref!r} returned {type(model).__name__}, not a torch.nn.Module."
            )
        return model

    def _dataset(self, given, split: str):
        if given is not None:
            return given
        ref = getattr(self.config.data, split)
        if not ref:
            return None
        key = f"data.{split}"
        factory = import_object(ref, key, self._base())
        try:
            dataset = factory(**self.config.data.args)
        except Exception as e:
            raise DataError(f"{key} = {ref!r} raised {type(e).__name__}: {e}.") from e
        check_dataset(dataset, f"{key} = {ref!r}")
        return dataset

    def _collator(self):
        ref = self.config.data.collator
        return import_object(ref, "data.collator", self._base()) if ref else None

    def _base(self) -> Path | None:
        return self.config.source.parent if self.config.source else None

    # -- events ----------------------------------------------------------------------------------
    def _fire(self, name: str, **kwargs) -> None:
        """Call an event hook, skipping the dispatch when no plugin implements it."""
        caller = self._events.get(name, 0)
        if caller == 0:
            caller = getattr(self.hook, name) if self.plugins.implemented(name) else None
            self._events[name] = caller
        if caller is not None:
            caller(loop=self, state=self.state, control=self.control, **kwargs)

    # -- set-up ------------------------------------------------------------------------------------
    def _setup_backend(self) -> None:
        if self.backend is None:
            self.backend = self.hook.create_backend(loop=self)
            s = self.state
            s.world_size = self.backend.num_processes
            s.is_world_process_zero = self.backend.is_main_process
            s.is_local_process_zero = self.backend.is_local_main_process

    def _setup_train(self):
        a, s = self.args, self.state
        if self.train_dataset is None:
            raise CorelooperError("No training data: pass train_dataset= or set data.train.")
        self._setup_backend()
        loader = self.hook.train_dataloader(loop=self, dataset=self.train_dataset)
        self.train_loader = loader  # its state_dict() (streaming data) goes into checkpoints
        try:
            batches_per_epoch = len(loader)
        except TypeError:
            batches_per_epoch = 0
        if batches_per_epoch == 0 and a.max_steps <= 0:
            raise DataError(
                "The training data has no length (or is empty): set train.max_steps, or give a "
                "dataset with samples."
            )
        s.steps_per_epoch = math.ceil(batches_per_epoch / a.gradient_accumulation_steps)
        s.max_steps = a.max_steps if a.max_steps > 0 else math.ceil(a.num_train_epochs * s.steps_per_epoch)
        s.num_train_epochs = math.ceil(s.max_steps / s.steps_per_epoch) if s.steps_per_epoch else 1
        s.logging_steps = resolve_interval(a.logging_steps, s.max_steps)  # a float < 1: a ratio (HF)
        s.save_steps = resolve_interval(a.save_steps, s.max_steps)
        s.eval_steps = resolve_interval(a.eval_steps or a.logging_steps, s.max_steps)
        s.train_batch_size = a.per_device_train_batch_size
        s.gradient_accumulation_steps = a.gradient_accumulation_steps

        from .model_options import apply_model_options

        self.model = apply_model_options(self, self.model)
        optimizer = self.hook.create_optimizer(loop=self, model=self.model)
        self.scheduler = self.hook.create_scheduler(
            loop=self, optimizer=optimizer, num_training_steps=s.max_steps
        )
        self.model, self.optimizer = self.backend.prepare(self.model, optimizer)
        self.forward_signature = forward_signature(self.backend.unwrap_model(self.model))
        impl = self.plugins.provider_impl("compute_loss")
        self._loss_is_mean = "num_items_in_batch" not in impl.argnames
        return loader

    # -- training ----------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | Path | None = None) -> LoopState:
        """Train for ``max_steps`` or ``num_train_epochs``; returns the final ``LoopState``.

        ``resume_from_checkpoint``: a checkpoint folder, or ``"latest"`` for the newest complete
        one in ``output_dir``.
        """
        a, s = self.args, self.state
        self._preemption = Preemption().install()  # SIGTERM/SIGINT: finish the step, save, stop
        try:
            try:
                set_seed(a.seed)
                loader = self._setup_train()
                resume = resume_from_checkpoint or a.resume_from_checkpoint
                output_dir = Path(a.output_dir)
                if resume:  # first: a bad checkpoint fails before output_dir is touched
                    checkpoint.load_checkpoint(self, checkpoint.resolve(resume, output_dir))
                if self.backend.is_main_process:
                    checkpoint.prepare_output_dir(self, output_dir, resuming=bool(resume))
                self._fire("on_train_begin")
                if a.eval_on_start:  # as HF: once, before the first step (also on resume)
                    self.evaluate()
                self._train_loop(loader)
            except BaseException as exc:
                self._fire_exception(exc)
                raise self._explain(exc) from exc
            self._fire("on_train_end")
        finally:
            self._preemption.restore()
        return s

    def _train_loop(self, loader) -> None:
        a, s, control = self.args, self.state, self.control
        ga = a.gradient_accumulation_steps
        start_epoch = round(s.epoch - s.step_in_epoch / s.steps_per_epoch) if s.steps_per_epoch else 0
        window_loss = torch.zeros((), device=self.backend.device)
        window_steps, grad_norm = 0, None
        window_start, window_samples, window_tokens = time.perf_counter(), 0, 0
        resumed = getattr(self, "_resumed_window", None)  # stopped mid logging window: continue its sums
        if resumed:
            window_loss += resumed["loss"]
            window_steps, window_samples, window_tokens = resumed["steps"], resumed["samples"], resumed["tokens"]
            self._resumed_window = None
        self.model.train()
        self._train_start = time.perf_counter()
        self._steps_at_start, self._samples_at_start = s.global_step, s.total_samples_seen

        for epoch in range(start_epoch, s.num_train_epochs):
            if s.global_step >= s.max_steps:
                break
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            if s.micro_batches_in_epoch and hasattr(loader, "skip") and not a.ignore_data_skip:
                loader.skip(s.micro_batches_in_epoch)
            batches = iter(loader)
            self._fire("on_epoch_begin")
            while s.global_step < s.max_steps:
                micro_batches = self._next_micro_batches(batches, ga)
                if not micro_batches:
                    break
                step_loss, grad_norm = self.training_step(micro_batches)

                s.global_step += 1
                s.step_in_epoch += 1
                s.micro_batches_in_epoch += len(micro_batches)
                s.epoch = epoch + (s.step_in_epoch / s.steps_per_epoch if s.steps_per_epoch else 0)
                window_loss += step_loss
                window_steps += 1
                n_samples = sum(batch_rows(b) for b in micro_batches) * s.world_size
                n_tokens = sum(count_input_tokens(b) for b in micro_batches) * s.world_size
                window_samples += n_samples
                window_tokens += n_tokens
                s.total_samples_seen += n_samples
                s.num_input_tokens_seen += count_tokens_seen(
                    micro_batches, a.tokens_seen_mode, self.backend, pad_token_id_of(self.data_collator),
                    getattr(self.backend.unwrap_model(self.model), "main_input_name", "input_ids"),
                )

                self._fire("on_step_end")
                if self._preemption.requested(self.backend):
                    preemption.stop(self)
                if control.should_log:
                    logs = self._window_logs(window_loss, window_steps, grad_norm, window_start,
                                             window_samples, window_tokens)
                    self.log(logs)
                    window_loss = torch.zeros((), device=self.backend.device)
                    window_steps, window_samples, window_tokens = 0, 0, 0
                    window_start = time.perf_counter()
                self._window = (window_loss, window_steps, window_samples, window_tokens)  # for a checkpoint
                self._evaluate_and_save()
                if control.should_epoch_stop or control.should_training_stop:
                    break
            if s.preempted:
                break  # the epoch did not end: its checkpoint must resume mid-epoch
            if not (control.should_training_stop and s.step_in_epoch < s.steps_per_epoch):
                s.step_in_epoch, s.micro_batches_in_epoch = 0, 0  # kept when stopped mid-epoch
            s.epoch = float(epoch + 1) if not control.should_training_stop else s.epoch
            control.should_epoch_stop = False
            self._fire("on_epoch_end")
            if control.should_log and window_steps:  # logging_strategy = "epoch"
                self.log(self._window_logs(window_loss, window_steps, grad_norm, window_start,
                                           window_samples, window_tokens))
                window_loss = torch.zeros((), device=self.backend.device)
                window_steps, window_samples, window_tokens = 0, 0, 0
                window_start = time.perf_counter()
            control.should_log = False
            self._evaluate_and_save()
            if control.should_training_stop:
                break

        if s.preempted:
            return  # checkpoint written; the run is not finished, so no final model
        if window_steps:
            self.log(self._window_logs(window_loss, window_steps, grad_norm, window_start,
                                       window_samples, window_tokens))
        self._finish_training()

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

    def training_step(self, micro_batches: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step over its micro-batches: normalised loss, backward, clip, step.

        Returns the step's loss (a detached tensor: no host sync) and the gradient norm.
        """
        model, backend, optimizer = self.model, self.backend, self.optimizer
        micro_batches = [backend.to_device(b) for b in micro_batches]
        num_items = self._num_items_in_batch(micro_batches)
        self.num_micro_batches = len(micro_batches)
        self._fire("on_step_begin")

        if self._optional_hook("split_micro_batches") is not None:
            micro_batches = self._split(micro_batches, training=True)
        while True:  # once, unless a retry_step plugin re-runs the step after an error (OOM)
            try:
                step_loss = self._accumulate(micro_batches, num_items)
                break
            except Exception as exc:
                retry = self._retry(exc, micro_batches, training=True)
                if retry is None:
                    raise
                micro_batches = retry
            self._release_failed_attempt(training=True)  # the traceback (activations) is gone now

        grad_norm = None
        if self.args.max_grad_norm > 0:
            grad_norm = backend.clip_grad_norm(model, self.args.max_grad_norm)
        self._fire("on_pre_optimizer_step", optimizer=optimizer)
        backend.optimizer_step(optimizer)
        self._fire("on_optimizer_step", optimizer=optimizer)
        self._applied_lr = self.scheduler.get_last_lr()[0]  # logged: the rate this step used (HF #36973)
        self.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # Each rank's step_loss is world * (its items' loss sum) / (global items): the mean over
        # ranks (reduce_mean when logging) is the global loss, as in one process.
        return step_loss, grad_norm

    def _accumulate(self, micro_batches: list, num_items) -> torch.Tensor:
        """Forward and backward of each micro-batch of a step; returns the step's summed loss."""
        model, backend = self.model, self.backend
        self.num_micro_batches = len(micro_batches)
        step_loss = torch.zeros((), device=backend.device)
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with nullcontext() if last else backend.no_sync(model):
                loss = self.hook.compute_loss(
                    loop=self, model=model, batch=batch, num_items_in_batch=num_items,
                    return_outputs=False,
                )
                if self._loss_is_mean:
                    loss = loss / len(micro_batches)
                elif backend.num_processes > 1:
                    loss = loss * backend.num_processes  # DDP averages gradients over ranks
                self._fire("on_before_backward", loss=loss)
                backend.backward(loss)
                self._fire("on_after_backward", loss=loss)
            step_loss += loss.detach()
            if not last:
                self._fire("on_substep_end")
        return step_loss

    # -- cutting and retrying steps (auto batch size) ----------------------------------------------
    def _optional_hook(self, name: str):
        """The caller of a hook no plugin has to implement, or None (looked up once per Loop)."""
        caller = self._events.get(name, 0)
        if caller == 0:
            caller = getattr(self.hook, name) if self.plugins.implemented(name) else None
            self._events[name] = caller
        return caller

    def _split(self, micro_batches: list, training: bool) -> list:
        split = self._optional_hook("split_micro_batches")
        new = split(loop=self, micro_batches=micro_batches, training=training) if split else None
        return micro_batches if new is None else new

    def _eval_batches(self, loader):
        """The evaluation batches, each cut smaller when a split_micro_batches plugin asks."""
        if self._optional_hook("split_micro_batches") is None:
            return loader
        return (piece for batch in loader for piece in self._split([batch], training=False))

    def _retry(self, exc: Exception, micro_batches: list | None, training: bool):
        """What a retry_step plugin wants to re-run after ``exc``; None: re-raise it."""
        retry_step = self._optional_hook("retry_step")
        if retry_step is None:
            return None
        return retry_step(loop=self, exception=exc, micro_batches=micro_batches, training=training)

    def _release_failed_attempt(self, training: bool) -> None:
        """Drop a failed attempt's partial gradients and cached device memory before a retry."""
        import gc

        if training:
            self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        device_module = getattr(torch, self.backend.device.type, None)
        if self.backend.device.type != "cpu" and hasattr(device_module, "empty_cache"):
            device_module.empty_cache()

    def _eval_with_retry(self, dataset, prefix: str, keep_outputs: bool = False):
        """``_run_eval``; after an error a retry_step plugin may run it again, from scratch."""
        was_training = self.model.training
        while True:
            try:
                return self._run_eval(dataset, prefix, keep_outputs=keep_outputs)
            except Exception as exc:
                if self._retry(exc, None, training=False) is None:
                    raise
            self.model.train(was_training)
            self._release_failed_attempt(training=False)

    def _num_items_in_batch(self, micro_batches: list):
        """Loss-bearing items of the whole optimizer step, over micro-batches and processes."""
        if self.loss_type == "auto":
            self.loss_type = resolve_loss_type(micro_batches[0])
        total = sum(count_loss_items(b, self.loss_type) for b in micro_batches)
        if not torch.is_tensor(total):
            total = torch.tensor(total)
        total = self.backend.reduce_sum(total.to(self.backend.device))
        return total.clamp(min=1)  # a step with no loss tokens has loss 0, not NaN

    # -- logging, evaluation, saving -----------------------------------------------------------------
    def _window_logs(self, window_loss, steps, grad_norm, start, samples, tokens) -> dict:
        elapsed = max(time.perf_counter() - start, 1e-9)
        loss = self.backend.reduce_mean(window_loss).item() / max(steps, 1)
        logs = {"loss": round(loss, 6) if math.isfinite(loss) else loss}
        if grad_norm is not None:
            logs["grad_norm"] = float(grad_norm)
        lr = getattr(self, "_applied_lr", None)  # 0.0 at the first warmup step is a real value
        logs["learning_rate"] = lr if lr is not None else self.scheduler.get_last_lr()[0]
        logs["epoch"] = round(self.state.epoch, 4)
        logs["samples_per_second"] = round(samples / elapsed, 2)
        if tokens:
            logs["tokens_per_second"] = round(tokens / elapsed, 2)
            if getattr(self, "_throughput", None) is None:
                from .throughput import ThroughputMeter

                self._throughput = ThroughputMeter(
                    self.backend.unwrap_model(self.model), self.args.peak_flops, self.state.world_size
                )
            logs.update(self._throughput.logs(tokens, samples, elapsed, self.state.num_input_tokens_seen))
            if self.args.tokens_seen_mode == "no":
                logs.pop("num_input_tokens_seen", None)
        return logs

    def log(self, logs: dict) -> None:
        """Record ``logs`` at the current step (``log_history``) and fire ``on_log``."""
        if self.args.tokens_seen_mode != "no":  # as HF's log(): in every log, eval ones too
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
        entry = {**logs, "step": self.state.global_step}
        self.state.log_history.append(entry)
        self.control.should_log = False
        if self.state.is_world_process_zero:
            self._fire("on_log", logs=logs)
            entry.update(logs)  # keys a (tryfirst) on_log plugin added, e.g. DPO reward margins

    def _evaluate_and_save(self) -> None:
        control, a = self.control, self.args
        if control.should_evaluate:
            control.should_evaluate = False
            metrics = self.evaluate()
            if hasattr(self.scheduler, "step_on_metrics"):  # reduce_lr_on_plateau, on every rank
                self.scheduler.step_on_metrics(metrics)
            if self._is_new_best(metrics) and a.save_strategy == "best":
                control.should_save = True
        if control.should_save:
            control.should_save = False
            checkpoint.save_checkpoint(self)

    def _is_new_best(self, metrics: dict) -> bool:
        a, s = self.args, self.state
        name = a.metric_for_best_model
        if name is None:
            return False
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            raise CorelooperError(
                f"train.metric_for_best_model = {name!r}, but the evaluation returned only "
                f"{sorted(metrics)}. Use one of those names."
            )
        value = float(metrics[key])
        better = s.best_metric is None or (
            value > s.best_metric if a.greater_is_better else value < s.best_metric
        )
        if better:
            s.best_metric, s.best_global_step = value, s.global_step
        return better

    def _finish_training(self) -> None:
        s = self.state
        runtime = time.perf_counter() - self._train_start
        steps = s.global_step - self._steps_at_start
        # Mean over every optimizer step, as HF's train_loss: each logged window loss counts for
        # the number of steps it averaged (windows differ, e.g. the last one).
        windows = [(h["loss"], h["step"]) for h in s.log_history if "loss" in h]
        prev_steps = [0] + [step for _, step in windows[:-1]]
        weighted = sum(loss * (step - prev) for (loss, step), prev in zip(windows, prev_steps, strict=True))
        summary = {
            "train_runtime": round(runtime, 4),
            "train_steps_per_second": round(steps / max(runtime, 1e-9), 3),
            "train_samples_per_second": round(
                (s.total_samples_seen - self._samples_at_start) / max(runtime, 1e-9), 3
            ),
            "train_loss": weighted / windows[-1][1] if windows else float("nan"),
        }
        if self.args.load_best_model_at_end and s.best_model_checkpoint:
            checkpoint.load_model(self, Path(s.best_model_checkpoint))
        checkpoint.save_model(self, Path(self.args.output_dir))
        if self.args.save_total_limit == 1 and s.best_model_checkpoint and self.backend.is_main_process:
            checkpoint.keep_only_best(Path(self.args.output_dir), s.best_model_checkpoint)
        self.log(summary)

    # -- evaluation and prediction -------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Loss over the whole evaluation set (token-weighted) and ``compute_metrics``."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise CorelooperError("No evaluation data: pass eval_dataset= or set data.eval.")
        metrics, _, _ = self._eval_with_retry(dataset, metric_key_prefix)
        # As HF's evaluate(): the metrics are logged (on_log, so every logger sees them), then
        # on_evaluate fires on every process (early stopping must decide the same on all ranks).
        self.log({**metrics, "epoch": round(self.state.epoch, 4)})
        self._fire("on_evaluate", metrics=metrics)
        return metrics

    def predict(self, test_dataset, metric_key_prefix: str = "test"):
        """Model outputs for every sample, in dataset order: ``(predictions, label_ids, metrics)``."""
        metrics, preds, labels = self._eval_with_retry(test_dataset, metric_key_prefix, keep_outputs=True)
        self._fire("on_predict", metrics=metrics)
        return preds, labels, metrics

    @torch.no_grad()
    def _run_eval(self, dataset, prefix: str, keep_outputs: bool = False):
        self._setup_eval_model()
        backend, model = self.backend, self.model
        want_outputs = keep_outputs or self.plugins.implemented_by_others("compute_metrics") or (
            self.compute_metrics_fn is not None
        )
        loader = self.hook.eval_dataloader(loop=self, dataset=dataset)
        was_training = model.training
        model.eval()
        loss_sum = torch.zeros((), device=backend.device, dtype=torch.float64)
        items = torch.zeros((), device=backend.device, dtype=torch.float64)
        from .predict import OutputAccumulator

        collected = OutputAccumulator(self.args.eval_accumulation_steps)  # on device, to CPU in chunks
        self.num_micro_batches = 1
        for batch in self._eval_batches(loader):
            batch = backend.to_device(batch)
            if self.loss_type == "auto":
                self.loss_type = resolve_loss_type(batch)
            n = count_loss_items(batch, self.loss_type)
            has_labels = split_batch(batch)[2] is not None
            outputs = None
            if has_labels:
                result = self.hook.compute_loss(
                    loop=self, model=model, batch=batch, num_items_in_batch=n, return_outputs=True
                )
                # a provider may ignore return_outputs and give the loss alone
                loss, outputs = result if isinstance(result, tuple) else (result, None)
                loss_sum += loss.detach().double() * n
                items += n
            if outputs is None and (want_outputs or not has_labels):
                args, kwargs, _ = split_batch(batch)
                if kwargs:
                    from .collators import model_inputs

                    kwargs = model_inputs(self, kwargs)
                outputs = model(*args, **kwargs)
            # the loss dropped, as HF's prediction_step
            if want_outputs and (predictions := predictions_of(outputs)) is not None:
                collected.add(predictions, split_batch(batch)[2] if has_labels else None)
            self._fire("on_prediction_step", batch=batch, outputs=outputs)
        model.train(was_training)

        loss_sum, items = backend.reduce_sum(loss_sum), backend.reduce_sum(items)
        metrics = {}
        if items.item() > 0:
            metrics[f"{prefix}_loss"] = round((loss_sum / items).item(), 6)
            # exp(loss) is a perplexity for a token-normalised causal-LM loss (a compute_loss that
            # takes num_items_in_batch), not for e.g. a per-pair DPO loss.
            impl = self.plugins.provider_impl("compute_loss")
            if self.loss_type == "causal_lm" and "num_items_in_batch" in impl.argnames:
                metrics[f"{prefix}_perplexity"] = round(math.exp(min(metrics[f"{prefix}_loss"], 700)), 4)
        predictions = label_ids = None
        if want_outputs and collected:
            predictions, label_ids = collected.gather(backend)  # dataset order, padded with -100
        if label_ids is not None:  # as HF: metrics need labels (predict() on unlabelled data has none)
            extra = self.hook.compute_metrics(loop=self, predictions=predictions, label_ids=label_ids)
            for k, v in (extra or {}).items():
                metrics[k if k.startswith(f"{prefix}_") else f"{prefix}_{k}"] = _scalar(v)
        return metrics, predictions, label_ids

    def _setup_eval_model(self) -> None:
        if self.backend is None:
            self._setup_backend()
        if self.optimizer is None and not getattr(self, "_eval_prepared", False):
            # evaluate()/predict() before any train(): FSDP / DeepSpeed must wrap the model too
            self.model = self.backend.prepare_model(self.model)
            self._eval_prepared = True
        if not hasattr(self, "forward_signature"):
            self.forward_signature = forward_signature(self.backend.unwrap_model(self.model))

    # -- errors --------------------------------------------------------------------------------------
    def _fire_exception(self, exc: BaseException) -> None:
        try:
            self._fire("on_exception", exception=exc)
        except Exception:  # a broken cleanup hook must not hide the original error
            pass

    def _explain(self, exc: BaseException) -> BaseException:
        """Turn an exception into one that names where it came from."""
        if isinstance(exc, CorelooperError) or not isinstance(exc, Exception):
            return exc
        blamed = self.plugins.blame(exc)
        if blamed:
            plugin, hook = blamed
            return PluginError(
                f"Plugin {plugin!r} raised in hook {hook!r} at global_step "
                f"{self.state.global_step}: {type(exc).__name__}: {exc}. Fix the plugin, or "
                f"disable it with `-p no:{plugin}`."
            )
        return TrainingError(
            f"Training failed at global_step {self.state.global_step}: {type(exc).__name__}: "
            f"{exc}. The error came from the model or its loss; the last complete checkpoint in "
            f"{self.args.output_dir!r} is untouched."
        )


def _scalar(v):
    if torch.is_tensor(v):
        return v.item()
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v


def check_dataset(dataset, what: str) -> None:
    """Fail early, naming the factory, when a dataset cannot be used by the default pipeline."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise DataError(
            f"{what} returned {type(dataset).__name__}, which is not a dataset: it needs "
            "__len__ and __getitem__ (a map-style torch Dataset), or must be an IterableDataset."
        )
    if len(dataset) == 0:
        raise DataError(f"{what} returned an empty dataset.")
    sample = dataset[0]
    if not (isinstance(sample, (dict, tuple, list)) or torch.is_tensor(sample)):
        raise DataError(
            f"{what}: sample 0 is a {type(sample).__name__}; samples must be dicts of tensors "
            "(e.g. {'input': ..., 'labels': ...}), tuples (inputs..., label) or tensors."
        )

