"""How the loop runs on the hardware. The default wraps accelerate's ``Accelerator``.

A backend is any object with the methods of ``Backend``; FSDP and DeepSpeed plugins return
their own from the ``create_backend`` hook.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from ..checkpoints.weights import torch_save
from ..gradients import parameters_of


class Backend(Protocol):
    """What the loop asks of a backend. Attributes: ``device``, ``process_index``,
    ``local_process_index``, ``num_processes``, ``is_main_process``, ``is_local_main_process``,
    ``mixed_precision``."""

    device: torch.device
    process_index: int
    local_process_index: int
    num_processes: int
    is_main_process: bool
    is_local_main_process: bool
    mixed_precision: str
    #: True when each rank holds only a shard of the parameters (FSDP, ZeRO-3): a plugin that
    #: needs the whole model on every rank must refuse at start-up (getattr default: False).
    shards_parameters: bool
    #: True when the number of micro-batches per optimizer step is fixed once the backend is
    #: built (an engine that owns gradient accumulation): a plugin that changes the micro-batch
    #: size mid-run must refuse at start-up (getattr default: False).
    fixed_accumulation: bool

    def prepare(self, model, optimizer):
        """Wrap model and optimizer for the hardware; returns ``(model, optimizer)``."""

    def prepare_model(self, model):
        """Wrap the model alone, for evaluation or prediction without training."""

    def to_device(self, batch): ...
    def no_sync(self, model) -> contextlib.AbstractContextManager: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def clip_grad_norm(self, model, max_norm: float) -> torch.Tensor: ...
    def optimizer_step(self, optimizer) -> None: ...
    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def gather(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def wait_for_everyone(self) -> None: ...
    def unwrap_model(self, model): ...
    def model_state_dict(self, model) -> dict[str, torch.Tensor]: ...
    def load_model_state_dict(self, model, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Full (unsharded) tensors into the model on every rank; ``strict=False``: a subset
        (an adapter's weights)."""

    def save_training_state(self, optimizer, directory) -> None: ...
    def load_training_state(self, optimizer, directory) -> None:
        """Optimizer (and engine) state from ``directory``, which may have been saved on another
        world size (``loop_state.json``'s ``world_size``): a backend that shards that state
        re-cuts it for this one, or raises ``CheckpointError`` saying so; never changes it."""

    def end(self) -> None: ...


def prepare_process_group() -> None:
    """Before ``init_process_group``: settle its threads at exit; then, started with plain
    ``python`` (no launcher), describe a group of one on a free port."""
    atexit.unregister(settle_process_group_threads)  # once, however many Loops
    atexit.register(settle_process_group_threads)
    if "RANK" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def settle_process_group_threads(timeout: float = 2.0) -> None:
    """At exit, while Python runs: wait until gloo's threads sleep. One that drops a finished
    collective's tensors in the interpreter's teardown aborts the process ("terminate called without
    an active exception"); they cannot be joined, as anything may keep their backend alive past
    ``destroy_process_group`` (torch._dynamo imported late, DTensor's caches)."""
    deadline, quiet = time.monotonic() + timeout, 0
    while quiet < 3 and time.monotonic() < deadline:  # the sleep hands them the GIL they may need
        time.sleep(0.005)
        quiet = quiet + 1 if all(state == "S" for state in gloo_thread_states()) else 0


def gloo_thread_states() -> list[str]:
    """The scheduler state (``R`` running, ``S`` asleep, ...) of each gloo thread (Linux)."""
    tasks = Path("/proc/self/task")
    try:
        gloo = [t for t in tasks.iterdir() if "gloo" in (t / "comm").read_text()] if tasks.is_dir() else []
        return [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in gloo]
    except OSError:  # a thread ended while listed: look again
        return ["?"]


def to_device(batch, device: torch.device):
    """``batch`` (tensors, nested in dicts, lists, tuples) on ``device``, without blocking; on the
    CPU as it is. The one copy every backend uses (``Backend.to_device``)."""
    if device.type == "cpu":
        return batch
    from accelerate.utils import send_to_device

    return send_to_device(batch, device, non_blocking=True)


class TorchDistributedCollectives:
    """Ranks and collectives straight over ``torch.distributed``: for the FSDP and DeepSpeed plugins'
    backends, and accelerate's (whose process group it is; its own reduce is the same all_reduce)."""

    num_processes: int
    device: torch.device

    def to_device(self, batch):
        return to_device(batch, self.device)

    def _set_rank_attributes(self, on_cuda: bool) -> None:
        """Rank facts from the joined process group; one CUDA device per local rank."""
        self.local_process_index = int(os.environ.get("LOCAL_RANK", 0))
        self.process_index = dist.get_rank()
        self.num_processes = dist.get_world_size()
        self.is_main_process = self.process_index == 0
        self.is_local_main_process = self.local_process_index == 0
        if on_cuda:
            torch.cuda.set_device(self.local_process_index)
            self.device = torch.device("cuda", self.local_process_index)
        else:
            self.device = torch.device("cpu")

    def reduce_sum(self, tensor):
        if self.num_processes == 1:
            return tensor
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def reduce_mean(self, tensor):
        if self.num_processes == 1:
            return tensor
        return self.reduce_sum(tensor) / self.num_processes

    def gather(self, tensor):
        """Concatenate ``tensor`` (dim 0 may differ per rank) from every process, rank order."""
        if self.num_processes == 1:
            return tensor
        return gather_varlen(tensor, self.device)

    def wait_for_everyone(self) -> None:
        if self.num_processes > 1:
            dist.barrier()


class WholeModel:
    """Model and optimizer steps of a backend whose every rank holds the whole model (DDP, one
    device): the user's module inside the wrappers, its full state dict, a plain optimizer step."""

    scaler = None  # accelerate's GradScaler under fp16

    def optimizer_step(self, optimizer):
        optimizer.step()

    def unwrap_model(self, model):
        return unwrap(model)

    def model_state_dict(self, model):
        return unwrap(model).state_dict()

    def load_model_state_dict(self, model, state_dict, strict: bool = True):
        self.unwrap_model(model).load_state_dict(state_dict, strict=strict)

    def save_training_state(self, optimizer, directory) -> None:
        if self.is_main_process:
            torch_save(optimizer.state_dict(), os.path.join(directory, "optimizer.pt"))
            if self.scaler is not None:  # fp16's loss scale
                torch_save(self.scaler.state_dict(), os.path.join(directory, "scaler.pt"))

    def load_training_state(self, optimizer, directory) -> None:
        state = torch.load(os.path.join(directory, "optimizer.pt"), map_location="cpu", weights_only=True)
        optimizer.load_state_dict(state)
        path = os.path.join(directory, "scaler.pt")
        if self.scaler is not None and os.path.exists(path):
            self.scaler.load_state_dict(torch.load(path, weights_only=True))


class AccelerateBackend(WholeModel, TorchDistributedCollectives):
    """DDP / single device / mixed precision through ``accelerate.Accelerator``.

    On CPU the accelerator is created with ``cpu=True``: without it, under torchrun, every rank
    would silently train on its own (``DistributedType.NO``).
    """

    shards_parameters = False
    fixed_accumulation = False

    def __init__(
        self,
        mixed_precision: str = "no",
        use_cpu: bool = False,
        ddp_timeout: int | None = None,
        ddp_kwargs: dict | None = None,
    ):
        from datetime import timedelta

        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
        from accelerate.utils import InitProcessGroupKwargs

        # Several Loops in one process (tests, notebooks) may ask for different precisions.
        AcceleratorState._reset_state()
        if os.environ.get("WORLD_SIZE", "1") != "1":  # accelerate starts the group
            prepare_process_group()
        cpu = use_cpu or not torch.cuda.is_available()
        if cpu and mixed_precision == "fp16":
            from ..errors import ConfigError

            raise ConfigError(
                'train.mixed_precision = "fp16" needs a CUDA device; on CPU use "bf16" or "no".'
            )
        handlers = []
        if ddp_timeout:  # train.ddp_timeout reaches init_process_group through accelerate
            handlers.append(InitProcessGroupKwargs(timeout=timedelta(seconds=ddp_timeout)))
        if ddp_kwargs:  # HF's ddp_find_unused_parameters, ddp_bucket_cap_mb, ... (train.ddp_*)
            from accelerate.utils import DistributedDataParallelKwargs

            handlers.append(DistributedDataParallelKwargs(**ddp_kwargs))
        self.accelerator = acc = Accelerator(
            cpu=cpu, mixed_precision=mixed_precision, kwargs_handlers=handlers
        )
        self.scaler = acc.scaler
        for fact in (
            "device",
            "process_index",
            "local_process_index",
            "num_processes",
            "is_main_process",
            "is_local_main_process",
        ):
            setattr(self, fact, getattr(acc, fact))
        self.mixed_precision = mixed_precision
        if self.num_processes > 1 and str(acc.distributed_type) == "DistributedType.NO":
            raise RuntimeError("world size > 1 but accelerate did not initialise distributed mode")

    # -- model ---------------------------------------------------------------------------
    def prepare(self, model, optimizer):
        if getattr(model, "_is_accelerate_prepared", False) and model is self.unwrap_model(model):
            # prepared for an evaluate() before train() (no DDP): accelerate would refuse to
            # wrap it again, and every rank would silently train on its own
            model._is_accelerate_prepared = False
        model = self.accelerator.prepare_model(model)
        if self.accelerator.scaler is not None or self.accelerator.distributed_type.value == "XLA":
            # AcceleratedOptimizer is needed for fp16 loss scaling; elsewhere it only adds
            # per-step overhead, so the plain optimizer is kept.
            optimizer = self.accelerator.prepare_optimizer(optimizer)
        return model, optimizer

    def prepare_model(self, model):
        return self.accelerator.prepare_model(model, evaluation_mode=True)

    def no_sync(self, model):
        if self.num_processes == 1:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(model)

    def backward(self, loss):
        if self.accelerator.scaler is None:
            loss.backward()
        else:
            self.accelerator.backward(loss)  # fp16: scaled loss

    def clip_grad_norm(self, model, max_norm: float):
        if self.accelerator.scaler is not None:
            self.accelerator.unscale_gradients()  # fp16: clip the true gradients
        # torch's own clip: accelerate's walks every module per call looking for FSDP/DTensors
        return torch.nn.utils.clip_grad_norm_(parameters_of(model), max_norm)

    def end(self):
        """After the last collective: trackers closed and the process group down (accelerate's)."""
        self.accelerator.end_training()


def unwrap(model):
    """The user's module inside DDP / torch.compile wrappers. (accelerate's unwrap_model imports
    optional engines when they are installed: half a second, on every call site.)"""
    while True:
        inner = getattr(model, "_orig_mod", None) or (
            model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
        )
        if inner is None:
            return model
        model = inner


def gather_varlen(tensor: torch.Tensor, device) -> torch.Tensor:
    """all_gather along dim 0 when ranks hold different numbers of rows."""
    world = dist.get_world_size()
    n = torch.tensor([tensor.shape[0]], device=device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    longest = max(sizes)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded.contiguous())
    return torch.cat([o[:s] for o, s in zip(out, sizes, strict=True)])
