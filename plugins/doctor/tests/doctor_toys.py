"""Small real models and datasets for the doctor's tests (CPU, seconds)."""

from __future__ import annotations

import time

import corelooper_doctor
import torch
from corelooper_testing import TensorSamples

from corelooper import Loop
from corelooper.config import Config

OUTLIER = 13  # the sample whose features are huge


class Square(torch.nn.Module):
    """x * x: overflows float32 (max 3.4e38) for |x| > 1.8e19."""

    def forward(self, x):
        return x * x


class Sqrt(torch.nn.Module):
    """Finite forward, infinite gradient at 0 (d sqrt(x)/dx = 1 / (2 sqrt(x)))."""

    def forward(self, x):
        return torch.sqrt(x)


class Classifier(torch.nn.Module):
    def __init__(self, middle: torch.nn.Module, features: int = 8, classes: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(features, 16), middle, torch.nn.Linear(16, classes))

    def forward(self, x):
        return self.body(x)


def relu_sqrt_model() -> Classifier:
    return Classifier(torch.nn.Sequential(torch.nn.ReLU(), Sqrt()))


def samples(n: int = 64, features: int = 8, outlier: float | None = None, seed: int = 0) -> TensorSamples:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(features, 3, generator=g)
    x = torch.randn(n, features, generator=g)
    y = (x @ w).argmax(-1)
    if outlier is not None:
        x[OUTLIER] = outlier
    return TensorSamples(x, y)


class Regression(TensorSamples):
    """{"x", "labels"} with float labels (MSE); one sample's target is far off: a loss spike."""


def spike_samples(n: int = 64, spike_index: int = OUTLIER, target: float = 300.0) -> Regression:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    y = x.sum(-1, keepdim=True)
    y[spike_index] = target
    return Regression(x, y)


class SlowSamples(TensorSamples):
    """Each sample takes ``delay`` seconds to load (an input-bound run)."""

    def __init__(self, x, y, delay: float):
        super().__init__(x, y)
        self.delay = delay

    def __getitem__(self, i: int) -> dict:
        time.sleep(self.delay)
        return super().__getitem__(i)


class OomAt(torch.nn.Module):
    """Raises the error CUDA raises, at a given training step: a CUDA OOM cannot happen on this
    CPU-only machine, so it is injected (the doctor only sees the exception, as on a GPU)."""

    def __init__(self, at_call: int):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        self.calls, self.at_call = 0, at_call

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == self.at_call:
                raise torch.OutOfMemoryError(
                    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                    "79.11 GiB of which 1.02 GiB is free."
                )
        return self.net(x)


def make_loop(tmp_path, model, train, doctor: dict | None = None, plugins=(), **train_args) -> Loop:
    args = {
        "output_dir": str(tmp_path / "run"),
        "max_steps": 8,
        "per_device_train_batch_size": 8,
        "learning_rate": 0.05,
        "lr_scheduler_type": "constant",
        "logging_steps": 2,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        **train_args,
    }
    config = Config.from_dict({"train": args, "doctor": {"hang_timeout": 120.0, **(doctor or {})}})
    return Loop(model, config, train_dataset=train, plugins=[corelooper_doctor, *plugins])


def doctor_of(loop):
    return loop.plugins.pm.get_plugin(corelooper_doctor.RUN_PLUGIN_NAME)
