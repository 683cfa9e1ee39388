"""``LocalBackend`` (one process, one device, full precision, no accelerate import) against
``AccelerateBackend`` on the same config: the same numbers, bit for bit, and the choice rule."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import toys
from conftest import REPO

from corelooper.backends.base import AccelerateBackend
from corelooper.backends.local import LocalBackend, local_device
from corelooper.loop import Loop


class ThroughAccelerate:
    """A plugin that answers create_backend with accelerate's backend (what the builtin chose
    before LocalBackend)."""

    name = "through_accelerate"

    def create_backend(self, loop):
        return AccelerateBackend("no", True)


def _train(train_args, tmp_path, name, plugins=()):
    args = train_args(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=6,
        max_grad_norm=1.0,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=3,
        weight_decay=0.1,
    )
    torch.manual_seed(0)  # the same initial weights for both
    loop = Loop(
        toys.mlp(),
        args,
        train_dataset=toys.Blobs(64),
        eval_dataset=toys.Blobs(16, seed=1),
        plugins=list(plugins),
        blocked_plugins=["console"],
    )
    loop.train()
    return loop


def _numbers(loop) -> list[tuple]:
    keys = ("step", "loss", "grad_norm", "learning_rate", "eval_loss")
    return [tuple(h.get(k) for k in keys) for h in loop.state.log_history if "loss" in h or "eval_loss" in h]


def test_local_and_accelerate_backends_train_the_same_numbers(train_args, tmp_path):
    local = _train(train_args, tmp_path, "local")
    accel = _train(train_args, tmp_path, "accel", [ThroughAccelerate()])
    assert type(local.backend) is LocalBackend and type(accel.backend) is AccelerateBackend
    assert _numbers(local) == _numbers(accel) and len(_numbers(local)) == 8  # 6 steps, 2 evaluations
    a, b = local.model.state_dict(), accel.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # each one's checkpoint resumes in the other's backend: the optimizer file is the same format
    torch.manual_seed(1)  # other initial weights: the checkpoint must replace them
    resumed = Loop(
        toys.mlp(),
        accel.args.__class__(**{**vars(accel.args), "max_steps": 6}),
        train_dataset=toys.Blobs(64),
        eval_dataset=toys.Blobs(16, seed=1),
        blocked_plugins=["console"],
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "accel" / "checkpoint-3"))
    c = resumed.model.state_dict()
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_which_backend_the_builtin_chooses(train_args, monkeypatch):
    loop = Loop(toys.mlp(), train_args(), train_dataset=toys.Blobs(16), blocked_plugins=["console"])
    assert type(loop.backend) is LocalBackend and loop.backend.device == torch.device("cpu")
    bf16 = Loop(
        toys.mlp(),
        train_args(mixed_precision="bf16"),
        train_dataset=toys.Blobs(16),
        blocked_plugins=["console"],
    )
    assert type(bf16.backend) is AccelerateBackend  # autocast: accelerate's
    monkeypatch.setenv("WORLD_SIZE", "2")  # what a launcher sets for each of its processes
    assert local_device(use_cpu=True) is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert local_device(use_cpu=True) == torch.device("cpu")


@pytest.mark.slow
def test_a_full_precision_run_does_not_import_accelerate(tmp_path):
    code = (
        "import sys, toys\n"
        "from corelooper.config import TrainArgs\n"
        "from corelooper.loop import Loop\n"
        f"args = TrainArgs(output_dir={str(tmp_path / 'o')!r}, max_steps=2, disable_tqdm=True)\n"
        "Loop(toys.mlp(), args, train_dataset=toys.Blobs(16), blocked_plugins=['console']).train()\n"
        "print('ACCELERATE', 'accelerate' in sys.modules)\n"
    )
    env = {"CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(REPO / "tests")}

    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "ACCELERATE False" in r.stdout
