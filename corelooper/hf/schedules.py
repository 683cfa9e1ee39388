"""Learning-rate schedules by name (``train.lr_scheduler_type``), with HF's values and options.

Each schedule is a multiplier of a parameter group's initial LR, applied by ``LambdaLR`` after
every optimizer step; the formulas are those of ``transformers.optimization`` so a run moved
from the HF Trainer keeps its LR curve. Options go in ``train.lr_scheduler_kwargs`` (HF's
name), e.g. ``{ num_cycles = 2 }`` for ``cosine_with_restarts``.

``reduce_lr_on_plateau`` is driven by the evaluation metric instead of the step: the loop calls
``step_on_metrics(metrics)`` after each evaluation during training, and its per-step ``step()``
does nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ConfigError
from ..metric import greater_for, metric_key, metric_value

LambdaFn = Callable[[int], float]


def warmup_steps_for(warmup: float, num_training_steps: int) -> int:
    """``warmup_steps``: an int number of steps, or a float < 1 read as a ratio of the run."""
    return math.ceil(warmup * num_training_steps) if 0 < warmup < 1 else int(warmup)


def _after_warmup(warmup: int, after: LambdaFn) -> LambdaFn:
    """A linear warmup from 0 over ``warmup`` steps, then ``after(step)`` (every HF schedule but WSD)."""

    def f(step: int) -> float:
        return step / max(1, warmup) if step < warmup else after(step)

    return f


def _progress(step: int, warmup: int, total: int) -> float:
    return (step - warmup) / max(1, total - warmup)


def linear(warmup: int, total: int) -> LambdaFn:
    def after(step: int) -> float:
        return max(0.0, (total - step) / max(1, total - warmup))

    return _after_warmup(warmup, after)


def cosine(warmup: int, total: int, num_cycles: float = 0.5) -> LambdaFn:
    def after(step: int) -> float:
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * _progress(step, warmup, total))))

    return _after_warmup(warmup, after)


def cosine_with_restarts(warmup: int, total: int, num_cycles: int = 1) -> LambdaFn:
    """``num_cycles`` hard restarts: the cosine falls to 0 and jumps back to the full LR."""

    def after(step: int) -> float:
        progress = _progress(step, warmup, total)
        if progress >= 1.0:
            return 0.0
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0))))

    return _after_warmup(warmup, after)


def polynomial(warmup: int, total: int, lr_init: float, lr_end: float = 1e-7, power: float = 1.0) -> LambdaFn:
    """From ``lr_init`` to ``lr_end`` as ``(1 - progress) ** power``; ``lr_end`` is absolute."""
    if not lr_init > lr_end:
        raise ConfigError(
            f"train.lr_scheduler_kwargs.lr_end ({lr_end}) must be smaller than "
            f"train.learning_rate ({lr_init}) for the polynomial schedule."
        )

    def after(step: int) -> float:
        if step > total:
            return lr_end / lr_init
        return ((lr_init - lr_end) * (1 - _progress(step, warmup, total)) ** power + lr_end) / lr_init

    return _after_warmup(warmup, after)


def inverse_sqrt(warmup: int, total: int, timescale: int | None = None) -> LambdaFn:
    """``1 / sqrt((step + shift) / timescale)`` after warmup (``timescale`` defaults to warmup)."""
    timescale = timescale or warmup or 10_000

    def after(step: int) -> float:
        return 1.0 / math.sqrt((step + timescale - warmup) / timescale)

    return _after_warmup(warmup, after)


def cosine_with_min_lr(
    warmup: int,
    total: int,
    lr_init: float,
    num_cycles: float = 0.5,
    min_lr: float | None = None,
    min_lr_rate: float | None = None,
) -> LambdaFn:
    """Cosine that ends at ``min_lr`` (absolute) or ``min_lr_rate`` (times the initial LR)."""
    if (min_lr is None) == (min_lr_rate is None):
        raise ConfigError(
            "lr_scheduler_type = 'cosine_with_min_lr' needs exactly one of min_lr or "
            "min_lr_rate in train.lr_scheduler_kwargs, e.g. lr_scheduler_kwargs = "
            "{ min_lr_rate = 0.1 }."
        )
    rate = min_lr / lr_init if min_lr is not None else min_lr_rate

    def after(step: int) -> float:
        factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * _progress(step, warmup, total)))
        return max(0.0, factor * (1 - rate) + rate)

    return _after_warmup(warmup, after)


_SHAPES = ("linear", "cosine", "1-sqrt")


def warmup_stable_decay(
    warmup: int,
    total: int,
    num_decay_steps: int | None = None,
    num_stable_steps: int | None = None,
    warmup_type: str = "linear",
    decay_type: str = "cosine",
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> LambdaFn:
    """Warmup, a flat stretch, then a decay over ``num_decay_steps`` (WSD)."""
    if num_decay_steps is None:
        raise ConfigError(
            "lr_scheduler_type = 'warmup_stable_decay' needs "
            "train.lr_scheduler_kwargs.num_decay_steps, e.g. lr_scheduler_kwargs = "
            "{ num_decay_steps = 100 }."
        )
    for key, value in (("warmup_type", warmup_type), ("decay_type", decay_type)):
        if value not in _SHAPES:
            raise ConfigError(
                f"train.lr_scheduler_kwargs.{key} = {value!r}: use one of {', '.join(_SHAPES)}."
            )
    stable = num_stable_steps if num_stable_steps is not None else total - warmup - num_decay_steps

    def f(step: int) -> float:
        if step < warmup:
            p = step / max(1, warmup)
            factor = {
                "linear": p,
                "cosine": 0.5 * (1.0 - math.cos(math.pi * p)),
                "1-sqrt": 1.0 - math.sqrt(1.0 - p),
            }[warmup_type]
            return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
        if step < warmup + stable:
            return 1.0
        if step < warmup + stable + num_decay_steps:
            p = (step - warmup - stable) / max(1, num_decay_steps)
            factor = {
                "linear": 1.0 - p,
                "cosine": 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * p)),
                "1-sqrt": 1.0 - math.sqrt(p),
            }[decay_type]
            return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
        return min_lr_ratio

    return f


def constant(warmup: int, total: int) -> LambdaFn:
    return lambda step: 1.0


def constant_with_warmup(warmup: int, total: int) -> LambdaFn:
    return _after_warmup(warmup, constant(warmup, total))


SCHEDULES: dict[str, Callable[..., LambdaFn]] = {
    f.__name__: f
    for f in (
        linear,
        cosine,
        cosine_with_restarts,
        polynomial,
        constant,
        constant_with_warmup,
        inverse_sqrt,
        cosine_with_min_lr,
        warmup_stable_decay,
    )
}
_NEEDS_LR = ("polynomial", "cosine_with_min_lr")
NAMES = (*SCHEDULES, "reduce_lr_on_plateau")


def lr_lambda(kind: str, warmup: int, total: int, lr_init: float | None = None, **kwargs: Any) -> LambdaFn:
    """The multiplier of schedule ``kind`` at each step (HF's ``get_scheduler`` values)."""
    if kind not in SCHEDULES:
        raise ConfigError(f"train.lr_scheduler_type = {kind!r} is unknown; use one of {', '.join(NAMES)}.")
    fn = SCHEDULES[kind]
    if kind in _NEEDS_LR:
        kwargs["lr_init"] = lr_init
    try:
        return fn(warmup, total, **kwargs)
    except TypeError as e:
        import inspect

        known = [p for p in inspect.signature(fn).parameters if p not in ("warmup", "total", "lr_init")]
        raise ConfigError(
            f"train.lr_scheduler_kwargs = {kwargs!r} does not fit lr_scheduler_type = {kind!r} ({e}); "
            f"its options are: {', '.join(known) or 'none'}."
        ) from None


class PlateauScheduler:
    """``ReduceLROnPlateau`` stepped by ``step_on_metrics(metrics)`` after each evaluation during
    training; ``step()``, called after every optimizer step, does nothing."""

    def __init__(self, optimizer, metric: str, greater_is_better: bool, **kwargs: Any):
        kwargs.setdefault("mode", "max" if greater_is_better else "min")
        try:
            self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, **kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"train.lr_scheduler_kwargs = {kwargs!r} is not valid for reduce_lr_on_plateau: {e}. "
                "Options: mode, factor, patience, threshold, threshold_mode, cooldown, min_lr, eps."
            ) from None
        self.metric = metric_key(metric)
        self.optimizer = optimizer

    def step(self, *_: Any) -> None:
        pass

    def step_on_metrics(self, metrics: dict[str, float]) -> None:
        # the metric is train.metric_for_best_model (default: loss)
        self.scheduler.step(metric_value(metrics, self.metric, "train.metric_for_best_model"))

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)


def create_scheduler(args, optimizer, num_training_steps: int):
    """The scheduler for ``args`` (``TrainArgs``): what the builtin ``create_scheduler`` returns."""
    kwargs = dict(args.lr_scheduler_kwargs or {})
    if args.lr_scheduler_type == "reduce_lr_on_plateau":
        metric = args.metric_for_best_model or "loss"
        return PlateauScheduler(optimizer, metric, greater_for(metric, args), **kwargs)
    warmup = warmup_steps_for(args.warmup_steps, num_training_steps)
    fn = lr_lambda(args.lr_scheduler_type, warmup, num_training_steps, optimizer.defaults["lr"], **kwargs)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
