"""``corelooper_hf.Trainer``: ``transformers.Trainer``'s constructor and public surface, run by corelooper.

Change ``from transformers import Trainer`` to ``from corelooper_hf import Trainer``: the same
``TrainingArguments``, datasets, collator, callbacks, ``report_to`` and subclass overrides run on
corelooper's ``Loop`` (its checkpoints, non-finite guard, run lock, SIGTERM checkpoint and
plugins), with HF's numbers: HF's ``DefaultFlowCallback`` decides when to log, evaluate and save,
HF's ``training_step`` / ``compute_loss`` / ``evaluation_loop`` compute (``hf_methods.py``), and
``state.log_history`` is HF's. What it cannot honour is refused when the ``Trainer`` is built.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from corelooper import Loop
from corelooper.seeding import rng_state, set_seed

from . import hf_checkpoint
from .bridge import CallbackBridge
from .convert import refuse_unhonoured_overrides, train_args
from .hf_methods import AcceleratorView, HFMethods
from .providers import DropInProviders


class DropInLoop(Loop):
    """The drop-in's ``Loop``: an evaluation during training goes through ``Trainer.evaluate``
    (HF's ``_evaluate``), so a subclass's ``evaluate`` override runs then too."""

    def __init__(self, trainer, *args: Any, **kwargs: Any) -> None:
        self.trainer = trainer
        super().__init__(*args, **kwargs)

    def evaluate(self, eval_dataset=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        if eval_dataset is None and metric_key_prefix == "eval":
            return self.trainer.evaluate(ignore_keys=self.trainer.ignore_keys_for_eval)
        return super().evaluate(eval_dataset, metric_key_prefix)


class Trainer(HFMethods):
    """``transformers.Trainer`` (5.x) as corelooper runs it: same constructor, same public API."""

    def __init__(
        self,
        model=None,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        model_init=None,
        compute_loss_func=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
    ) -> None:
        from transformers import TrainingArguments
        from transformers.trainer_callback import CallbackHandler, TrainerControl, TrainerState

        refuse_unhonoured_overrides(type(self))
        self.args = args if args is not None else TrainingArguments(output_dir="trainer_output")
        self.model_init = model_init
        self.model = self._resolve_model(model, model_init)
        self._inspect_model(self.model)
        self.data_collator = (
            data_collator if data_collator is not None else _default_collator(processing_class)
        )
        self.train_dataset, self.eval_dataset, self.processing_class = (
            train_dataset,
            eval_dataset,
            processing_class,
        )
        self.compute_loss_func, self.compute_metrics = compute_loss_func, compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self.loss_is_scaled_for_ga = None
        self.current_gradient_accumulation_steps = 1
        self.ignore_keys = self.ignore_keys_for_eval = None
        self.hp_name = self.hp_search_backend = None
        self.is_in_train = False
        self.current_flos, self._flos_parameters = 0.0, None
        self.model_preparation_time = None
        self.callback_handler = CallbackHandler(
            _default_callbacks(self.args) + list(callbacks or []),
            self.model,
            processing_class,
            self.optimizer,
            self.lr_scheduler,
        )
        self.add_callback(_progress_callback(self.args))
        self.control = TrainerControl()
        self.state = TrainerState()
        self._bridge_logging = False
        self.bridge = CallbackBridge(
            self.args, self.callback_handler, self.state, self.control, self._bridge_log
        )
        self.hf_resume = None  # a checkpoint transformers.Trainer wrote, until train() begins
        self.train_rng, self.sampler_seed = None, self.args.seed
        self._providers = DropInProviders(self)
        self._loop = self._build_loop()
        self.accelerator = AcceleratorView(self._loop)
        self.state.is_world_process_zero = self._loop.state.is_world_process_zero
        self.state.is_local_process_zero = self._loop.state.is_local_process_zero
        if getattr(self.model, "config", None) is not None and hasattr(self.args, "use_cache"):
            self.model.config.use_cache = self.args.use_cache

    # -- construction -------------------------------------------------------------------------------
    def _resolve_model(self, model, model_init):
        if model is None and model_init is None:
            raise RuntimeError("`Trainer` requires either a `model` or `model_init` argument")
        if model is not None and model_init is not None:
            raise ValueError("`Trainer` requires either a `model` or `model_init` argument, but not both.")
        if model is not None:
            return model
        set_seed(self.args.seed)  # as HF: seeded before model_init
        return self.call_model_init()

    def _inspect_model(self, model) -> None:
        """HF's model introspection: loss kwargs, label names, the causal shift, label smoothing."""
        import inspect

        from transformers.trainer_pt_utils import LabelSmoother
        from transformers.utils import can_return_loss, find_labels

        inner = getattr(model, "get_base_model", lambda: model)()
        if hasattr(inner, "accepts_loss_kwargs"):
            self.model_accepts_loss_kwargs = inner.accepts_loss_kwargs
        else:
            params = inspect.signature(inner.forward).parameters.values()
            self.model_accepts_loss_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
        self.label_names = (
            find_labels(inner.__class__) if self.args.label_names is None else self.args.label_names
        )
        self.can_return_loss = can_return_loss(inner.__class__)
        self._loss_shifts_labels = _loss_shifts_labels(inner)
        smoothing = self.args.label_smoothing_factor
        self.label_smoother = LabelSmoother(epsilon=smoothing) if smoothing else None

    def _build_loop(self) -> DropInLoop:
        return DropInLoop(
            self,
            self.model,
            train_args(self.args),
            train_dataset=self._for_model(self.train_dataset),
            eval_dataset=_map_datasets(self.eval_dataset, self._for_model),
            data_collator=self._collator_for_model(),
            plugins=[self.bridge, self._providers],
            # HF's DefaultFlowCallback and progress callback run in the handler instead
            blocked_plugins=["flow", "console"],
        )

    def _signature_columns(self) -> list[str]:
        import inspect

        inner = getattr(self.model, "get_base_model", lambda: self.model)()
        columns = list(inspect.signature(inner.forward).parameters)
        return list(dict.fromkeys([*columns, "label", "label_ids", *self.label_names]))

    def _for_model(self, dataset):
        """HF's ``remove_unused_columns`` for a ``datasets.Dataset``: the columns ``forward`` does
        not take are dropped before batching (other datasets: by the collator)."""
        if dataset is None or not self.args.remove_unused_columns or not hasattr(dataset, "remove_columns"):
            return dataset
        ignored = sorted(set(dataset.column_names) - set(self._signature_columns()))
        return dataset.remove_columns(ignored) if ignored else dataset

    def _collator_for_model(self):
        if not self.args.remove_unused_columns:
            return self.data_collator
        return ForwardColumns(self.data_collator, self._signature_columns())

    # -- training -----------------------------------------------------------------------------------
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial=None,
        ignore_keys_for_eval=None,
        **kwargs,
    ):
        """Train; returns HF's ``TrainOutput(global_step, training_loss, metrics)``.

        ``resume_from_checkpoint``: ``True`` for the newest checkpoint in ``args.output_dir``, a
        corelooper checkpoint folder, or a folder an HF ``Trainer`` wrote (``checkpoint-N`` with
        ``trainer_state.json``: weights, optimizer, scheduler and RNG read with ``weights_only``;
        ``training_args.bin``, a pickle, is never opened): the run moves over mid-training."""
        from transformers.trainer_utils import TrainOutput

        if kwargs:
            raise TypeError(f"train() got unexpected keyword arguments: {', '.join(kwargs)}.")
        self.ignore_keys_for_eval = ignore_keys_for_eval
        resume = _resume_target(resume_from_checkpoint, self.args.output_dir)
        self.train_rng = None
        if resume is not None and hf_checkpoint.is_hf_checkpoint(resume):
            self._from_hf_checkpoint(resume)  # restored when train() begins (DropInProviders)
            resume = None
        elif resume is None:
            _warn_fresh_run_over(self.args.output_dir, self.is_world_process_zero())
            if self.model_init is not None:  # as HF: the model anew, seeded, at every train()
                self._reinit_model(trial)
            # HF does not seed again in train(): training draws on from here (on_train_begin)
            self.train_rng = rng_state()
        # HF's sampler seed without data_seed: torch's initial seed now (args.seed, unless model_init
        # or other code seeded torch since), not args.seed
        self.sampler_seed = self.args.data_seed if self.args.data_seed is not None else torch.initial_seed()
        self.is_in_train = True
        try:
            self._loop.train(resume_from_checkpoint=resume)
        finally:
            self.is_in_train = False
        self.state.global_step, self.state.epoch = self._loop.state.global_step, self._loop.state.epoch
        summary = next((h for h in reversed(self.state.log_history) if "train_runtime" in h), {})
        # as HF's: its printing callbacks pop total_flos from the summary they are given
        metrics = {k: v for k, v in summary.items() if k not in ("step", "total_flos")}
        return TrainOutput(self.state.global_step, metrics.get("train_loss", 0.0), metrics)

    def call_model_init(self, trial=None):
        """``model_init()``, or ``model_init(trial)`` when it takes the trial (HF's)."""
        import inspect

        takes_trial = len(inspect.signature(self.model_init).parameters) == 1
        model = self.model_init(trial) if takes_trial else self.model_init()
        if model is None:
            raise RuntimeError("model_init should not return None.")
        return model

    def _reinit_model(self, trial) -> None:
        set_seed(self.args.seed)
        fresh = self.call_model_init(trial)
        self._loop.backend.unwrap_model(self._loop.model).load_state_dict(fresh.state_dict())

    def _from_hf_checkpoint(self, folder: str) -> None:
        """A checkpoint transformers.Trainer wrote: read whole before the run starts, its weights
        loaded now (as HF loads them before preparing the model), the rest at on_train_begin."""
        backend = self._loop.backend
        saved = hf_checkpoint.read(folder, backend.process_index, backend.num_processes)
        hf_checkpoint.load_weights(backend.unwrap_model(self._loop.model), saved.weights, saved.folder)
        saved.weights = {}
        self.hf_resume = saved

    def _bridge_log(self, logs: dict) -> None:
        """corelooper's ``on_log``, told to the (overridable) ``Trainer.log`` as HF calls it."""
        if "train_runtime" in logs:  # the run summary: HF's total_flos before train_loss
            self.store_flos()
            logs = _with_total_flos(logs, self.state.total_flos)
        self._bridge_logging = True
        try:
            self.log(logs)
        finally:
            self._bridge_logging = False

    # -- evaluation and prediction ----------------------------------------------------------------
    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Loss and ``compute_metrics`` over ``eval_dataset`` (or ``self.eval_dataset``; a dict of
        them: each, its name in the metric keys), logged, then ``on_evaluate`` (HF's ``evaluate``)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, dict):
            metrics: dict[str, float] = {}
            for name, part in dataset.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        self.ignore_keys = ignore_keys
        prepared = self._loop.eval_dataset if eval_dataset is None else self._for_model(dataset)
        if prepared is not None:
            self._prepare_for_evaluation()
        metrics = Loop.evaluate(self._loop, prepared, metric_key_prefix)
        return {**metrics, "epoch": self.state.epoch}  # as HF's: the dict its log() added epoch to

    def _prepare_for_evaluation(self) -> None:
        """The backend wraps the model before an evaluation without train(); HF reports the time."""
        if self._loop.optimizer is None and self.model_preparation_time is None:
            started = time.time()
            self._loop.prepare_for_evaluation()
            self.model_preparation_time = round(time.time() - started, 4)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test"):
        """Predictions and labels (numpy, dataset order) and metrics: HF's ``PredictionOutput``."""
        from transformers.trainer_utils import PredictionOutput

        self.ignore_keys = ignore_keys
        self._prepare_for_evaluation()
        predictions, label_ids, metrics = self._loop.predict(self._for_model(test_dataset), metric_key_prefix)
        return PredictionOutput(predictions=predictions, label_ids=label_ids, metrics=metrics)

    # -- saving -----------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model's weights (safetensors) and the processing class into ``output_dir``
        (``args.output_dir``); ``training_args.json`` instead of HF's pickled ``training_args.bin``."""
        out = Path(output_dir if output_dir is not None else self.args.output_dir)
        backend = self._loop.backend
        state_dict = backend.model_state_dict(self._loop.model)  # a sharded model's, gathered
        if not backend.is_main_process:
            return
        out.mkdir(parents=True, exist_ok=True)
        model = backend.unwrap_model(self._loop.model)
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
        else:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state_dict.items()}, str(out / "model.safetensors"))
        if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
            self.processing_class.save_pretrained(out)
        (out / "training_args.json").write_text(self.args.to_json_string())

    def save_state(self) -> None:
        """``trainer_state.json`` in ``args.output_dir``, as HF writes it."""
        if self.is_world_process_zero():
            self.state.save_to_json(os.path.join(self.args.output_dir, "trainer_state.json"))

    # -- callbacks and processes ------------------------------------------------------------------
    def add_callback(self, callback) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.remove_callback(callback)

    def is_world_process_zero(self) -> bool:
        return self._loop.state.is_world_process_zero if hasattr(self, "_loop") else True

    def is_local_process_zero(self) -> bool:
        return self._loop.state.is_local_process_zero if hasattr(self, "_loop") else True

    def export_config(self, path: str | Path) -> Path:
        """Write a corelooper config with this Trainer's arguments (``[train]``, HF names; the
        ones that differ from HF's defaults) and a ``[model]``/``[data]`` skeleton to fill in."""
        from .export import export_config

        return export_config(self.args, path)

    @property
    def loop(self) -> Loop:
        """The corelooper ``Loop`` that runs this Trainer (its plugins, backend and state)."""
        return self._loop

    def hyperparameter_search(
        self,
        hp_space=None,
        compute_objective=None,
        n_trials: int = 20,
        direction="minimize",
        backend=None,
        hp_name=None,
        **kwargs,
    ):
        """HF's ``hyperparameter_search`` with Optuna (corelooper-optuna): a fresh Trainer per trial
        from ``model_init``; returns HF's ``BestRun`` (``corelooper_hf.trainer.search``)."""
        from .search import hyperparameter_search

        return hyperparameter_search(
            self, hp_space, compute_objective, n_trials, direction, backend, hp_name, **kwargs
        )


def _warn_fresh_run_over(output_dir: str, speaks: bool) -> None:
    from corelooper.checkpoints.run_dir import final_model_files, list_checkpoints

    folder = Path(output_dir)
    if not speaks or not folder.is_dir():
        return
    earlier = [p.name for p in list_checkpoints(folder)] + [p.name for p in final_model_files(folder)]
    if earlier:
        warnings.warn(
            f"args.output_dir {str(folder)!r} holds an earlier run ({', '.join(earlier)}): train() without "
            "resume_from_checkpoint starts it over and removes them, as HF's Trainer writes over them. "
            "Pass resume_from_checkpoint=True to continue that run instead.",
            stacklevel=3,
        )


def _with_total_flos(summary: dict, total_flos: float) -> dict:
    out = {k: v for k, v in summary.items() if k not in ("train_loss", "epoch")}
    out["total_flos"] = total_flos
    return {**out, **{k: summary[k] for k in ("train_loss", "epoch") if k in summary}}


class ForwardColumns:
    """HF's ``RemoveColumnsCollator``: each sample keeps only the columns ``forward`` takes (a
    shallow copy, so a collator that pops keys leaves the dataset's samples whole), then
    ``data_collator``. A sample with no other column is copied whole: one set test per sample where
    HF's filter looks every key up in a list (the drop-in's per-step cost, issue 47)."""

    def __init__(self, data_collator, signature_columns: list[str]) -> None:
        self.data_collator, self.signature_columns = data_collator, frozenset(signature_columns)

    def __call__(self, features: list):
        columns, for_forward = self.signature_columns, self.for_forward
        # the common sample inline (a dict with no other column): no method call per sample
        kept = [dict(f) if type(f) is dict and f.keys() <= columns else for_forward(f) for f in features]
        return self.data_collator(kept)

    def for_forward(self, feature):
        if not isinstance(feature, dict):
            return feature
        if feature.keys() <= self.signature_columns:
            return dict(feature)
        return {k: v for k, v in feature.items() if k in self.signature_columns}


def _default_collator(processing_class):
    from transformers import DataCollatorWithPadding, default_data_collator
    from transformers.feature_extraction_sequence_utils import SequenceFeatureExtractor
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    if isinstance(processing_class, (PreTrainedTokenizerBase, SequenceFeatureExtractor)):
        return DataCollatorWithPadding(processing_class)
    return default_data_collator


def _default_callbacks(args) -> list:
    from transformers.integrations import get_reporting_integration_callbacks
    from transformers.trainer_callback import DefaultFlowCallback

    return [DefaultFlowCallback, *get_reporting_integration_callbacks(args.report_to)]


def _progress_callback(args):
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    return PrinterCallback if args.disable_tqdm else ProgressCallback


def _loss_shifts_labels(model) -> bool:
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    is_encoder_decoder = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    return LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss and not is_encoder_decoder


def _map_datasets(dataset, fn):
    return {k: fn(v) for k, v in dataset.items()} if isinstance(dataset, dict) else fn(dataset)


def _resume_target(resume, output_dir: str):
    if resume is None or resume is False:
        return None
    if resume is True:
        return "latest"
    return str(resume)
