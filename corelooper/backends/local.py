"""The builtin backend for one process on the CPU in full precision (``LocalBackend``).

What accelerate's ``Accelerator`` does there is nothing beyond the plain calls below; importing
accelerate costs ~0.1 s of start-up, more than the whole first step of a small model (a laptop
run, a test, a notebook). Several processes, bf16 or fp16, and every accelerator (where CUDA's
start-up dwarfs that import) go through ``AccelerateBackend`` (``corelooper.backends.base``). Both give
the same numbers, bit for bit: ``tests/test_local_backend.py`` runs one config on each.
"""

from __future__ import annotations

import contextlib
import itertools
import os

import torch

from ..gradients import clip_grad_norm_, parameters_of
from .base import TorchDistributedCollectives, WholeModel


def local_device(use_cpu: bool) -> torch.device | None:
    """The CPU when ``LocalBackend`` runs this process, else ``None`` (use accelerate): several
    processes (a launcher set ``WORLD_SIZE``), or an accelerator that is there and not refused."""
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        return None
    mps = getattr(torch.backends, "mps", None)
    if not use_cpu and (torch.cuda.is_available() or (mps is not None and mps.is_available())):
        return None
    return torch.device("cpu")


class LocalBackend(WholeModel, TorchDistributedCollectives):
    shards_parameters = False
    fixed_accumulation = False

    def __init__(self, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"LocalBackend runs on the CPU, not {device}: use AccelerateBackend")
        self.device = device
        self.process_index = self.local_process_index = 0
        self.num_processes = 1
        self.is_main_process = self.is_local_main_process = True
        self.mixed_precision = "no"

    def prepare(self, model, optimizer):
        return self.prepare_model(model), optimizer

    def prepare_model(self, model):
        # As accelerate: a model dispatched over several devices (device_map) stays where it is.
        if len(set(getattr(model, "hf_device_map", {}).values())) > 1:
            return model
        tensors = itertools.chain(model.parameters(), model.buffers())
        if any(t.device != self.device for t in tensors):  # a model built on the CPU needs no .to()
            model = model.to(self.device)
        return model

    def to_device(self, batch):
        return batch  # already on the CPU

    def no_sync(self, model):
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()

    def clip_grad_norm(self, model, max_norm: float):
        return clip_grad_norm_(parameters_of(model), max_norm)  # torch's result, less of its Python

    def end(self) -> None:
        pass
