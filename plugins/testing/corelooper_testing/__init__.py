"""A pytest plugin for plugin authors (entry point ``pytest11``, loaded whenever corelooper-testing is installed).

Fixtures:

* ``run_loop(plugins=[...], sections={...}, **train_overrides)`` trains a tiny classifier on CPU
  (a few hundred parameters, 8 optimizer steps, evaluations and checkpoints) with your plugins
  registered and returns the ``Loop``; ``make_loop`` builds the same ``Loop`` without training.
* ``hook_recorder``: a plugin that records every event and every provider call with its arguments.
* ``train_args(**overrides)``: a ``TrainArgs`` for a quick in-process ``Loop`` (no checkpoints).

Installed plugins (entry points) are *not* loaded by these fixtures unless ``autoload=True``, so a
test sees only the plugins it names. This module must not import torch at import time: pytest loads
it in every test run of every project that has corelooper-testing installed.
"""

from __future__ import annotations

__version__ = "0.2.0"

import inspect
import os
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from corelooper import hookspecs

# Arguments every event receives; the recorder keeps them out of HookCall.kwargs (see HookCall).
_CONTEXT = ("loop", "state", "control")


@dataclass
class HookCall:
    """One hook call: its name, its arguments (without loop/state/control), and the step it fired at.

    ``logs``/``metrics`` dicts are copied and tensors detached when recorded, so later changes
    do not alter the record. Provider calls also carry ``result`` (what the first answer returned).
    """

    name: str
    kwargs: dict[str, Any]
    global_step: int | None = None
    epoch: float | None = None
    result: Any = None

    def __getitem__(self, key: str) -> Any:
        return self.kwargs[key]


@dataclass
class HookRecorder:
    """A plugin recording every hook call, in order: register it with ``Loop(plugins=[recorder])``.

    It implements every event (so none is skipped) and watches provider calls through pluggy's
    hook-call monitoring (so it changes no provider's answer).
    """

    name: str = "recorder"
    calls: list[HookCall] = field(default_factory=list)

    def names(self) -> list[str]:
        return [c.name for c in self.calls]

    def calls_of(self, name: str) -> list[HookCall]:
        return [c for c in self.calls if c.name == name]

    def count(self, name: str) -> int:
        return len(self.calls_of(name))

    def last(self, name: str) -> HookCall:
        found = self.calls_of(name)
        if not found:
            raise LookupError(f"hook {name!r} was never called; called: {sorted(set(self.names()))}")
        return found[-1]

    def clear(self) -> None:
        self.calls.clear()

    def _record(self, name: str, kwargs: dict[str, Any], result: Any = None) -> None:
        state = kwargs.get("state")
        if state is None and kwargs.get("loop") is not None:
            state = getattr(kwargs["loop"], "state", None)
        args = {k: _snapshot(v) for k, v in kwargs.items() if k not in _CONTEXT}
        self.calls.append(
            HookCall(
                name,
                args,
                getattr(state, "global_step", None),
                getattr(state, "epoch", None),
                result,
            )
        )


def _snapshot(value: Any) -> Any:
    if isinstance(value, dict):
        return dict(value)
    detach = getattr(value, "detach", None)
    return detach() if callable(detach) else value


def _make_event(name: str) -> Callable:
    params = list(inspect.signature(getattr(hookspecs, name)).parameters)
    src = (
        f"def {name}(self, {', '.join(params)}):\n"
        f"    self._record({name!r}, {{{', '.join(f'{p!r}: {p}' for p in params)}}})\n"
    )
    namespace: dict[str, Any] = {}
    exec(src, namespace)  # a real signature: pluggy passes arguments by name
    fn = namespace[name]
    fn.__qualname__ = f"HookRecorder.{name}"
    return fn


def _watch_providers(self: HookRecorder, loop) -> None:
    """on_init_end: watch this loop's provider calls (they all come after it)."""
    self._record("on_init_end", {"loop": loop})
    pending: list[dict] = []

    def before(hook_name, hook_impls, kwargs):
        if hook_name in hookspecs.PROVIDERS:
            pending.append(dict(kwargs))

    def after(outcome, hook_name, hook_impls, kwargs):
        if hook_name in hookspecs.PROVIDERS and pending:
            call_kwargs = pending.pop()
            if outcome.exception is None:
                self._record(hook_name, call_kwargs, result=outcome.get_result())

    loop.plugins.pm.add_hookcall_monitoring(before, after)


for _event in hookspecs.EVENTS:
    setattr(HookRecorder, _event, _make_event(_event))
HookRecorder.on_init_end = lambda self, loop: _watch_providers(self, loop)  # type: ignore[attr-defined]
HookRecorder.on_init_end.__qualname__ = "HookRecorder.on_init_end"


# --------------------------------------------------------------------------------------------
# A tiny, fast, real training task
# --------------------------------------------------------------------------------------------


class SigtermAt:
    """Sends this process a real SIGTERM at ``at_step``: the loop's preemption handler finishes the
    step, saves a checkpoint and ends training with ``state.preempted`` (as a scheduler would)."""

    name = "sigterm"

    def __init__(self, at_step: int):
        self.at_step = at_step

    def on_step_end(self, state):
        if state.global_step == self.at_step:
            os.kill(os.getpid(), signal.SIGTERM)


def tiny_task(n_train: int = 64, n_eval: int = 32, features: int = 8, classes: int = 3, seed: int = 0):
    """(model, train_dataset, eval_dataset, compute_metrics) for a seeded, learnable classification.

    Samples are ``{"x": float[features], "labels": int}``; labels come from a fixed random linear
    map, so the loss really goes down.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(features, classes, generator=g)
    x = torch.randn(n_train + n_eval, features, generator=g)
    y = (x @ w).argmax(-1)
    train = TensorSamples(x[:n_train], y[:n_train])
    evaluation = TensorSamples(x[n_train:], y[n_train:])
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(features, 16), torch.nn.ReLU(), torch.nn.Linear(16, classes))
    return _Named(model), train, evaluation, accuracy


def tiny_model(seed: int = 0):
    """The tiny task's model, for a config: ``[model] factory = "corelooper_testing:tiny_model"``
    (to test a plugin through the real ``corelooper run``)."""
    return tiny_task(seed=seed)[0]


def tiny_train_set(seed: int = 0, **_: Any):
    """The tiny task's 64 training samples, for a config: ``[data] train = "corelooper_testing:tiny_train_set"``."""
    return tiny_task(seed=seed)[1]


def tiny_eval_set(seed: int = 0, **_: Any):
    """The tiny task's 32 evaluation samples, for a config: ``[data] eval = "corelooper_testing:tiny_eval_set"``."""
    return tiny_task(seed=seed)[2]


class TensorSamples:
    """A map-style dataset of ``{"x": ..., "labels": ...}`` samples held in two tensors."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


def _Named(module):
    """Wrap a Sequential so it takes the batch key ``x`` by name."""
    import torch

    class TinyClassifier(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x)

    return TinyClassifier(module)


def accuracy(predictions, label_ids) -> dict[str, float]:
    return {"accuracy": (predictions.argmax(-1) == label_ids).float().mean().item()}


TINY_TRAIN_ARGS: dict[str, Any] = {
    "max_steps": 8,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 32,
    "learning_rate": 0.05,
    "lr_scheduler_type": "constant",
    "logging_steps": 2,
    "eval_strategy": "steps",
    "eval_steps": 4,
    "save_strategy": "steps",
    "save_steps": 4,
    "disable_tqdm": True,
    "seed": 0,
}


def build_loop(
    plugins: Iterable[Any] = (),
    *,
    output_dir: str | Path,
    sections: dict[str, dict[str, Any]] | None = None,
    blocked: Iterable[str] = (),
    autoload: bool = False,
    **train_overrides: Any,
):
    """A ``Loop`` on the tiny task (see ``tiny_task``) with ``plugins`` registered."""
    from corelooper.config import Config
    from corelooper.loop import Loop
    from corelooper.plugins import AUTOLOAD_ENV

    config = Config.from_dict(
        {
            "train": {**TINY_TRAIN_ARGS, "output_dir": str(output_dir), **train_overrides},
            **(sections or {}),
        }
    )
    model, train, evaluation, metrics = tiny_task()
    saved = os.environ.get(AUTOLOAD_ENV)
    if autoload:
        os.environ.pop(AUTOLOAD_ENV, None)
    else:
        os.environ[AUTOLOAD_ENV] = "1"
    try:
        return Loop(
            model,
            config,
            train_dataset=train,
            eval_dataset=evaluation,
            compute_metrics=metrics,
            plugins=list(plugins),
            blocked_plugins=list(blocked),
        )
    finally:
        if saved is None:
            os.environ.pop(AUTOLOAD_ENV, None)
        else:
            os.environ[AUTOLOAD_ENV] = saved


@pytest.fixture
def hook_recorder() -> HookRecorder:
    """A fresh ``HookRecorder``: pass it in ``plugins=[...]``, then assert on ``.calls``."""
    return HookRecorder()


@pytest.fixture
def train_args(tmp_path):
    """``train_args(**overrides)`` -> a ``TrainArgs`` for a quick in-process ``Loop``: output in
    ``tmp_path / "out"``, no checkpoints, a log every step, no clipping, no progress bar."""

    def make(**overrides: Any):
        from corelooper.config import TrainArgs

        base = dict(
            output_dir=str(tmp_path / "out"),
            save_strategy="no",
            logging_steps=1,
            max_grad_norm=0.0,
            disable_tqdm=True,
            learning_rate=1e-2,
        )
        return TrainArgs(**{**base, **overrides})

    return make


@pytest.fixture
def make_loop(tmp_path):
    """``make_loop(plugins=[...], sections={...}, **train_overrides)`` -> an untrained ``Loop``.

    ``output_dir`` defaults to ``tmp_path / "run"``; ``autoload=True`` also loads installed plugins.
    """

    def make(plugins: Iterable[Any] = (), **kwargs: Any):
        kwargs.setdefault("output_dir", tmp_path / "run")
        return build_loop(plugins, **kwargs)

    return make


@pytest.fixture
def run_loop(make_loop):
    """``run_loop(plugins=[...], sections={...}, resume=None, **train_overrides)`` -> the trained ``Loop``.

    Trains the tiny task for 8 steps (logs every 2, evaluates and saves every 4) in about a
    second on CPU. ``resume="latest"`` continues the run in the same ``output_dir``. The Loop is
    closed afterwards, as the CLI closes it (``corelooper_unconfigure``: loggers end their runs).
    """

    def run(plugins: Iterable[Any] = (), *, resume: str | Path | None = None, **kwargs: Any):
        if resume is not None:  # in the config, as the CLI's --resume-from-checkpoint
            kwargs["resume_from_checkpoint"] = str(resume)
        with make_loop(plugins, **kwargs) as loop:
            loop.train()
        return loop

    return run
