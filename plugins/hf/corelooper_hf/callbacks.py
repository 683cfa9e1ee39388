"""HF's ``TrainerCallback``s in a ``corelooper run`` (``corelooper_hf.reporting`` chooses them):
the ``TrainingArguments`` they get, their ``CallbackHandler`` and the run's ``CallbackBridge``.
Imported when a run has HF callbacks (it imports torch and transformers)."""

from __future__ import annotations

import functools
import logging
import os
import warnings

from .trainer.bridge import CallbackBridge


@functools.cache
def run_arguments_class() -> type:
    """``TrainingArguments`` that describe a corelooper run: building one sets up no device and no
    process group (HF's ``_setup_devices`` would make accelerate's ``PartialState``, and start a
    process group under a launcher, before corelooper's backend does): the device and the ranks
    are read from the launcher's environment, as corelooper's backend reads them."""
    from functools import cached_property

    import torch
    from transformers import TrainingArguments
    from transformers.training_args import ParallelMode

    class RunArguments(TrainingArguments):
        @cached_property
        def _setup_devices(self) -> torch.device:
            self.distributed_state = None
            self._n_gpu = 1 if torch.cuda.is_available() and not self.use_cpu else 0
            return torch.device("cuda", self.local_process_index) if self._n_gpu else torch.device("cpu")

        @property
        def world_size(self) -> int:
            return int(os.environ.get("WORLD_SIZE", 1))

        @property
        def process_index(self) -> int:
            return int(os.environ.get("RANK", 0))

        @property
        def local_process_index(self) -> int:
            return int(os.environ.get("LOCAL_RANK", 0))

        @property
        def parallel_mode(self):
            return ParallelMode.DISTRIBUTED if self.world_size > 1 else ParallelMode.NOT_DISTRIBUTED

    return RunArguments


def training_arguments(config):
    """HF's ``TrainingArguments`` for the run: every ``[train]`` value that ``TrainingArguments``
    has a field for (output_dir, run_name, seed, logging_steps, learning_rate, eval_strategy,
    metric_for_best_model, ...; ``mixed_precision`` as bf16 / fp16), ``report_to=[]``. A value HF
    refuses here (corelooper accepts more: ``tf32`` on a CPU, an optimizer HF has no name for) is
    left at HF's default: these arguments only describe the run to the callbacks."""
    import dataclasses

    cls = run_arguments_class()
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    train = config.train
    values = {f.name: getattr(train, f.name) for f in dataclasses.fields(train) if f.name in fields}
    if getattr(train, "mixed_precision", None) in ("bf16", "fp16"):
        values[train.mixed_precision] = True
    values = {k: v for k, v in values.items() if k in fields}
    base = {"output_dir": str(train.output_dir), "report_to": []}
    values.update(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # HF's notes on its renamed fields: not the user's
        args = _build(cls, values)
        if args is None:
            kept = {k: v for k, v in values.items() if k in base or _build(cls, {**base, k: v}) is not None}
            args = _build(cls, kept) or cls(**base)  # some values refused only together: HF's defaults
    return args


def _build(cls: type, values: dict):
    try:
        return cls(**values)
    except Exception:
        return None


class _NoFlowWarning(logging.Filter):
    def filter(
        self, record: logging.LogRecord
    ) -> bool:  # corelooper's flow policy is HF's DefaultFlowCallback
        return "DefaultFlowCallback" not in record.getMessage()


def make_handler(callbacks: list):
    """HF's ``CallbackHandler`` for ``callbacks``, without its warning that ``DefaultFlowCallback``
    is missing (corelooper's builtin ``flow`` policy is that callback)."""
    from transformers.trainer_callback import CallbackHandler

    quiet = _NoFlowWarning()
    log = logging.getLogger("transformers.trainer_callback")
    log.addFilter(quiet)
    try:
        return CallbackHandler(callbacks, None, None, None, None)
    finally:
        log.removeFilter(quiet)


class ReportingBridge(CallbackBridge):
    """The ``CallbackBridge`` of a ``corelooper run`` (``hf.callbacks``), with what a run needs
    beyond the drop-in ``Trainer``'s:

    * the callbacks get the logs of ``metrics.jsonl`` (less corelooper's per-window throughput,
      which HF's logs have not);
    * an MLflow run that HF's ``MLflowCallback`` started stays open after ``on_train_end`` (a run
      may evaluate after training: ``corelooper run`` does when ``eval_strategy = "no"``, and
      MLflow would start a second run for those metrics) and is ended, flushed, when the Loop
      ends (``corelooper_unconfigure``): FAILED after an exception, else FINISHED.
    """

    def __init__(self, args, handler) -> None:
        super().__init__(args, handler, log=self.record_run_log)
        self._tokens_logged = False
        self.failed = False

    def on_log(self, loop, logs) -> None:
        self._tokens_logged = "num_input_tokens_seen" in logs
        super().on_log(loop, logs)

    def record_run_log(self, logs: dict) -> None:
        """The log as corelooper logged it (``metrics.jsonl``), without its throughput keys:
        ``num_input_tokens_seen`` only when corelooper counted tokens (HF would log a 0 then)."""
        if not self._tokens_logged:
            logs.pop("num_input_tokens_seen", None)
        self.record_log(logs)

    def _mlflow_callbacks(self) -> list:
        return [
            cb for cb in self.handler.callbacks if hasattr(cb, "_auto_end_run") and hasattr(cb, "_ml_flow")
        ]

    def on_train_end(self, loop) -> None:
        held = [cb for cb in self._mlflow_callbacks() if cb._auto_end_run]
        for cb in held:
            cb._auto_end_run = False
        try:
            super().on_train_end(loop)
        finally:
            for cb in held:
                cb._auto_end_run = True

    def on_exception(self) -> None:
        self.failed = True

    def corelooper_unconfigure(self) -> None:
        for cb in self._mlflow_callbacks():
            if cb._auto_end_run and cb._ml_flow.active_run() is not None:
                cb._ml_flow.end_run(status="FAILED" if self.failed else "FINISHED")
                cb._auto_end_run = False
