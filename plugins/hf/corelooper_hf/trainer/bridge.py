"""corelooper's events, told to Hugging Face ``TrainerCallback``s as HF's ``CallbackHandler`` tells them.

A ``CallbackBridge`` is one corelooper plugin per run. At each event it brings HF's
``TrainerState`` up to date from the ``LoopState`` and HF's ``TrainerControl`` from the run's
``Control``, calls the handler's method of the same name with HF's ``(args, state, control,
**kwargs)`` (``model``, ``processing_class``, ``optimizer``, ``lr_scheduler``,
``train_dataloader``, ``eval_dataloader``, and ``logs`` / ``metrics`` where HF gives them), then
copies the flags the callbacks set back into the run's ``Control``: a callback that sets
``control.should_training_stop`` stops the run, as in HF.

HF's stateful callbacks (``ExportableState``, e.g. ``EarlyStoppingCallback``) are saved in every
corelooper checkpoint (``plugins.json``, under "hf_callbacks", in HF's ``stateful_callbacks``
format) and restored from it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CONTROL_FLAGS = ("should_training_stop", "should_epoch_stop", "should_save", "should_evaluate", "should_log")
FLAGS_BUT_EVALUATE = tuple(flag for flag in CONTROL_FLAGS if flag != "should_evaluate")
# LoopState fields HF's TrainerState has under the same name and meaning.
STATE_FIELDS = (
    "global_step",
    "epoch",
    "max_steps",
    "num_train_epochs",
    "logging_steps",
    "eval_steps",
    "save_steps",
    "train_batch_size",
    "num_input_tokens_seen",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
    "is_world_process_zero",
    "is_local_process_zero",
)
BEST_FIELDS = ("best_metric", "best_global_step", "best_model_checkpoint")
# Events of every optimizer step, and the flags HF's CallbackHandler clears before telling the
# callbacks: when no callback implements one, the bridge only syncs the state and clears them.
STEP_EVENTS = {
    "on_step_begin": ("should_log", "should_evaluate", "should_save"),
    "on_substep_end": (),
    "on_pre_optimizer_step": (),
    "on_optimizer_step": (),
    "on_step_end": (),
}
# corelooper's keys in a training log that HF's log has not (HF logs the run's throughput once, at the end).
CORELOOPER_ONLY_LOG_KEYS = frozenset({"samples_per_second", "tokens_per_second", "skipped_steps"})


def hf_logs(logs: dict[str, Any]) -> dict[str, Any]:
    """A corelooper log as HF's ``Trainer.log`` receives it: without corelooper's per-window
    throughput, and without ``epoch`` / ``num_input_tokens_seen`` (HF's ``log`` adds those)."""
    skip = CORELOOPER_ONLY_LOG_KEYS | {"epoch", "num_input_tokens_seen"}
    return {k: v for k, v in logs.items() if k not in skip}


class CallbackBridge:
    """A per-run corelooper plugin that runs HF ``TrainerCallback``s through ``handler``.

    ``args`` is a ``transformers.TrainingArguments``; ``state`` / ``control`` are HF's
    ``TrainerState`` / ``TrainerControl`` (the drop-in ``Trainer``'s own, or new ones);
    ``log(logs)`` records a log HF's way (default: ``log_history`` and ``handler.on_log``; the
    drop-in ``Trainer`` passes its overridable ``Trainer.log``).
    """

    name = "hf_callbacks"

    def __init__(self, args, handler, state=None, control=None, log: Callable | None = None) -> None:
        from transformers.trainer_callback import TrainerCallback, TrainerControl, TrainerState

        self.args, self.handler, self.no_op = args, handler, TrainerCallback
        self.state = state if state is not None else TrainerState()
        self.control = control if control is not None else TrainerControl()
        self.log = log if log is not None else self.record_log
        self.told = 0  # entries of the run's log_history the callbacks were told of (other ranks)

    # -- the mapping ------------------------------------------------------------------------------
    def sync_state(self, loop_state, keep: tuple[str, ...] = ()) -> None:
        """HF's ``TrainerState`` from the run's ``LoopState`` (but the fields in ``keep``)."""
        for name in STATE_FIELDS:
            if name not in keep:
                setattr(self.state, name, getattr(loop_state, name))

    def call(self, event: str, loop, **kwargs: Any) -> None:
        """``handler.<event>(args, state, control, **kwargs)`` with the run's state and flags.

        At ``on_evaluate`` the callbacks see the best metric as it was before this evaluation,
        as in HF (its Trainer updates it after ``on_evaluate``; corelooper's ``best_metric``
        policy before): ``EarlyStoppingCallback`` compares with the previous best."""
        if event == "on_train_begin":  # a resumed history was told in the run that wrote it
            self.told = len(loop.state.log_history)
        self.tell_other_ranks_logs(loop)
        if event in STEP_EVENTS and not self.heard(event):  # the same outcome, without the calls
            self.step_without_callbacks(loop, event)
            return
        self.sync_state(loop.state, keep=BEST_FIELDS if event == "on_evaluate" else ())
        # corelooper clears should_evaluate before it evaluates, HF at on_evaluate: while HF's
        # evaluation runs, its control keeps the flag (user code may read it)
        flags = CONTROL_FLAGS if event != "on_prediction_step" else FLAGS_BUT_EVALUATE
        for flag in flags:
            setattr(self.control, flag, getattr(loop.control, flag))
        self.attach(loop)
        self.control = getattr(self.handler, event)(self.args, self.state, self.control, **kwargs)
        for flag in flags:
            setattr(loop.control, flag, getattr(self.control, flag))

    def step_without_callbacks(self, loop, event: str) -> None:
        """A step event no callback implements: HF's state and flags as the handler would leave
        them (only what a step moves is copied: the rest changes at events that are told)."""
        state, control = loop.state, loop.control
        self.state.global_step, self.state.epoch = state.global_step, state.epoch
        self.state.num_input_tokens_seen = state.num_input_tokens_seen
        for flag in CONTROL_FLAGS:
            setattr(self.control, flag, getattr(control, flag))
        for flag in STEP_EVENTS[event]:  # what HF's CallbackHandler clears before telling
            setattr(self.control, flag, False)
            setattr(control, flag, False)

    def heard(self, event: str) -> bool:
        """Whether a callback implements ``event`` (``TrainerCallback``'s own methods do nothing)."""
        no_op = getattr(self.no_op, event)
        return any(
            getattr(type(cb), event, no_op) is not no_op or event in getattr(cb, "__dict__", ())
            for cb in self.handler.callbacks
        )

    def attach(self, loop) -> None:
        """The objects HF's handler passes to every callback, as the run has them now."""
        backend = loop.backend
        model = loop.model if backend is None else backend.unwrap_model(loop.model)
        handler = self.handler
        handler.model, handler.optimizer, handler.lr_scheduler = model, loop.optimizer, loop.scheduler
        handler.train_dataloader = loop.train_loader

    def record_log(self, logs: dict[str, Any]) -> None:
        """HF's ``Trainer.log`` after it added ``epoch``: the history, then ``on_log``."""
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.handler.on_log(self.args, self.state, self.control, logs)

    # -- corelooper events --------------------------------------------------------------------------
    def corelooper_configure(self, config, plugins) -> None:
        plugins.register_for_checkpointing("hf_callbacks", StatefulCallbacks(self))

    def on_init_end(self, loop) -> None:
        self.call("on_init_end", loop)

    def on_train_begin(self, loop) -> None:
        self.call("on_train_begin", loop)

    def on_epoch_begin(self, loop) -> None:
        self.call("on_epoch_begin", loop)

    def on_step_begin(self, loop) -> None:
        self.call("on_step_begin", loop)

    def on_substep_end(self, loop) -> None:
        self.call("on_substep_end", loop)

    def on_pre_optimizer_step(self, loop) -> None:
        self.call("on_pre_optimizer_step", loop)

    def on_optimizer_step(self, loop) -> None:
        self.call("on_optimizer_step", loop)

    def on_step_end(self, loop) -> None:
        self.call("on_step_end", loop)

    def on_epoch_end(self, loop) -> None:
        self.call("on_epoch_end", loop)

    def on_log(self, loop, logs) -> None:
        self.told = len(loop.state.log_history)
        self.tell_log(loop, logs)

    def tell_log(self, loop, logs: dict) -> None:
        """One log of the run, HF's way: ``log(entry)`` with ``epoch`` (and tokens) as HF adds them."""
        self.sync_state(loop.state)
        for flag in CONTROL_FLAGS:
            setattr(self.control, flag, getattr(loop.control, flag))
        self.attach(loop)
        entry = hf_logs(logs)
        entry["epoch"] = loop.state.epoch
        if getattr(self.args, "include_num_input_tokens_seen", "no") not in ("no", False):
            entry["num_input_tokens_seen"] = loop.state.num_input_tokens_seen
        self.log(entry)
        for flag in CONTROL_FLAGS:
            setattr(loop.control, flag, getattr(self.control, flag))

    def tell_other_ranks_logs(self, loop) -> None:
        """corelooper fires ``on_log`` on the main process only; HF tells every rank's callbacks.
        On the other ranks the logs the run recorded since the last event are told now, at the
        next event: where HF's order has them (after ``on_step_end``, before ``on_evaluate``,
        ``on_save``, the next ``on_step_begin`` or ``on_train_end``)."""
        history = loop.state.log_history
        if loop.state.is_world_process_zero:
            return
        while self.told < len(history):
            entry = history[self.told]
            self.told += 1
            self.tell_log(loop, {k: v for k, v in entry.items() if k != "step"})

    def on_evaluate(self, loop, metrics) -> None:
        self.call("on_evaluate", loop, metrics=metrics)

    def on_predict(self, loop, metrics) -> None:
        self.call("on_predict", loop, metrics=metrics)

    def on_prediction_step(self, loop) -> None:
        self.call("on_prediction_step", loop)

    def on_save(self, loop) -> None:
        self.call("on_save", loop)

    def on_train_end(self, loop) -> None:
        self.call("on_train_end", loop)


class StatefulCallbacks:
    """HF's ``ExportableState`` callbacks in corelooper checkpoints (``register_for_checkpointing``),
    in the format of HF's ``TrainerState.stateful_callbacks``: ``{class name: state}``, or a list
    of states when several callbacks of one class are there."""

    def __init__(self, bridge: CallbackBridge) -> None:
        self.bridge = bridge

    def _stateful(self) -> list:
        from transformers.trainer_callback import ExportableState

        return [cb for cb in self.bridge.handler.callbacks if isinstance(cb, ExportableState)]

    def state_dict(self) -> dict[str, Any]:
        saved: dict[str, Any] = {}
        for cb in self._stateful():
            name = type(cb).__name__
            if name in saved:
                saved[name] = [*(saved[name] if isinstance(saved[name], list) else [saved[name]]), cb.state()]
            else:
                saved[name] = cb.state()
        return saved

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if not getattr(self.bridge.args, "restore_callback_states_from_checkpoint", True):
            return  # as HF: restored only when asked
        by_class: dict[str, list] = {}
        for cb in self._stateful():
            by_class.setdefault(type(cb).__name__, []).append(cb)
        for name, callbacks in by_class.items():
            states = saved.get(name)
            if states is None:
                continue
            states = states if isinstance(states, list) else [states]
            for cb, state in zip(callbacks, states, strict=False):
                for key, value in state.get("attributes", {}).items():
                    setattr(cb, key, value)
