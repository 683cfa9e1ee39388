"""The per-run part of the plugin: finds the largest micro-batch that fits, and remembers it.

One ``AutoBatchSize`` is registered per ``Loop`` (by ``corelooper_configure``, only when
``train.auto_find_batch_size`` is true), so its state belongs to that run and is saved in the
checkpoint's ``plugins.json`` (``register_for_checkpointing``).

Multi-process agreement (as Composer's auto-microbatching): every process passes the same two
sync points per step attempt — after the forward of the step's last micro-batch (before its
gradient-synchronising backward) and after that backward — where the processes all-reduce a
failure flag. A process that hits an error announces it at the place of its next sync point
(from ``retry_step``); the others learn it there and abandon the attempt too. So all shrink
together, and no process is left waiting in a collective.
"""

from __future__ import annotations

import gc
import logging
import math

import torch

from corelooper.data.loader import tensor_rows
from corelooper.errors import ConfigError, TrainingError

from .batches import cut, cut_all, is_oom, sample_shape

log = logging.getLogger("corelooper.auto_batch_size")

from .settings import DEFAULTS, SECTION  # noqa: F401, E402  (re-exported)


class PeerFailed(RuntimeError):
    """Raised on this process when another process failed the current step attempt."""

    def __init__(self, fatal: bool):
        super().__init__("another process " + ("failed" if fatal else "hit an OOM") + " in this step")
        self.fatal = fatal


class AutoBatchSize:
    """Halves the micro-batch (doubling accumulation) on OOM and retries the same step.

    It is the run's ``training_step`` and ``evaluation_loop`` provider: in a retry loop, it asks
    the next ``training_step`` provider (``plugins.call_next``: the builtin
    ``default_training_step`` unless a plugin answers before it) and runs
    ``corelooper.evaluation.run_evaluation``, with the batches cut to the size found.
    """

    def __init__(self, options: dict, args):
        self.args = args
        self.probe = bool(options["probe"])
        self.min_size = int(options["min_micro_batch_size"])
        self.handle_eval = bool(options["eval"])
        if self.min_size < 1:
            raise ConfigError(f"{SECTION}.min_micro_batch_size must be >= 1, got {self.min_size}.")
        self.train_size: int | None = None  # rows per training micro-batch, once shrunk
        self.eval_size: int | None = None  # rows per evaluation batch, once shrunk
        self._world = 1
        self._seen = 0  # micro-batches of the current attempt that reached on_before_backward
        self._pieces = 0  # micro-batches in the current attempt
        self._last_eval_batch = None

    # -- checkpointed state ------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"train_micro_batch_size": self.train_size, "eval_batch_size": self.eval_size}

    def load_state_dict(self, state: dict) -> None:
        self.train_size = state.get("train_micro_batch_size")
        self.eval_size = state.get("eval_batch_size")

    # -- events ---------------------------------------------------------------------------------
    def on_init_end(self, loop) -> None:
        check_backend(loop.backend)

    def on_train_begin(self, loop, state) -> None:
        self._world = loop.backend.num_processes
        if self._world > 1 and is_sharded(loop.model):
            raise ConfigError(
                f"train.auto_find_batch_size = true cannot recover safely with a model sharded over "
                f"{self._world} processes (FSDP / tensor parallel): its forward and backward gather "
                "parameters from every process, so an out-of-memory error on one process would "
                "leave the others waiting in that collective. Choose per_device_train_batch_size "
                "and gradient_accumulation_steps by hand for sharded runs (auto batch size works "
                "with the default DDP backend)."
            )
        if self.probe:
            self._probe(loop)

    def on_before_backward(self, loop) -> None:
        self._seen += 1
        if self._world > 1 and self._seen == self._pieces:
            self._check_peers(loop)  # before the backward that synchronises gradients

    def on_after_backward(self, loop) -> None:
        if self._world > 1 and self._seen == self._pieces:
            self._check_peers(loop)

    # -- providers --------------------------------------------------------------------------------
    def training_step(self, loop, micro_batches: list):
        while True:
            pieces = self._cut(micro_batches, self.train_size)
            self._seen, self._pieces = 0, len(pieces)
            try:
                return loop.plugins.call_next("training_step", self, loop=loop, micro_batches=pieces)[0]
            except Exception as exc:  # keep no reference: its traceback holds the activations
                if not self._retry_training(loop, exc, pieces):
                    raise
            loop.optimizer.zero_grad(set_to_none=True)  # the failed attempt's partial gradients
            free_memory(loop.backend)

    training_step.corelooper_role = "wraps"  # the next provider's step, retried: `corelooper plugins`

    def evaluation_loop(self, loop, dataset, metric_key_prefix: str, keep_outputs: bool):
        from corelooper.evaluation import run_evaluation

        while True:
            try:
                return run_evaluation(
                    loop, dataset, metric_key_prefix, keep_outputs, batch_transform=self._cut_eval
                )
            except Exception as exc:
                if not (self.handle_eval and is_oom(exc)):
                    raise
                self._shrink(loop, training=False, example=self._last_eval_batch, cause=exc)
            free_memory(loop.backend)

    def _cut(self, micro_batches: list, size: int | None) -> list:
        if size is None or all(tensor_rows(b) <= size for b in micro_batches):
            return micro_batches
        return cut_all(micro_batches, size)

    def _cut_eval(self, batch) -> list:
        self._last_eval_batch = batch
        return self._cut([batch], self.eval_size)

    def _retry_training(self, loop, exception: Exception, pieces: list) -> bool:
        """After a failed attempt: shrink (True) or let the error propagate (False)."""
        oom = is_oom(exception)
        if isinstance(exception, PeerFailed):
            if exception.fatal:
                raise TrainingError(
                    f"Another process failed during training step {loop.state.global_step + 1} "
                    "(its error is reported by that process); this one stops too."
                ) from None
            oom = True
        elif self._world > 1:  # announce at the place of this attempt's next sync point
            others = self._agree(loop, 1 if oom else 0, fatal=not oom)
            if others > self._world:  # a process failed with something other than OOM
                return False
        if not oom:
            return False
        reset_ddp_reducer(loop.model)
        self._shrink(loop, training=True, example=pieces[0], cause=exception)
        return True

    # -- helpers ----------------------------------------------------------------------------------
    def _agree(self, loop, flag: int, fatal: bool = False) -> int:
        """Sum over processes of each one's flag (0 ok, 1 OOM, world+1 fatal)."""
        value = self._world + 1 if fatal else flag
        total = loop.backend.reduce_sum(torch.tensor([float(value)], device=loop.backend.device))
        return int(total.item())

    def _check_peers(self, loop) -> None:
        total = self._agree(loop, 0)
        if total:
            raise PeerFailed(fatal=total > self._world)

    def _configured(self, loop, training: bool) -> int:
        a = loop.args
        return a.per_device_train_batch_size if training else a.per_device_eval_batch_size

    def _shrink(self, loop, training: bool, example, cause: BaseException) -> None:
        current = (self.train_size if training else self.eval_size) or self._configured(loop, training)
        if current <= self.min_size:
            raise TrainingError(too_big_message(loop, training, current, example, cause)) from None
        new = max(self.min_size, current // 2)
        if training:
            self.train_size = new
        else:
            self.eval_size = new
        what = "training micro-batch" if training else "evaluation batch"
        steps = self.micro_batches_per_step(loop)
        extra = f" ({steps} micro-batches per optimizer step)" if training else ""
        if loop.state.is_world_process_zero:
            log.warning(
                "auto_find_batch_size: out of memory with a %s of %d; retrying with %d%s.",
                what,
                current,
                new,
                extra,
            )
        logs = (
            {"train_micro_batch_size": new, "micro_batches_per_step": steps}
            if training
            else {"eval_batch_size": new}
        )
        loop.log(logs)

    def micro_batches_per_step(self, loop) -> int:
        a = loop.args
        size = self.train_size or a.per_device_train_batch_size
        return a.gradient_accumulation_steps * math.ceil(a.per_device_train_batch_size / size)

    def _probe(self, loop) -> None:
        """Forward + backward of one real micro-batch of the size in use, before training.

        No optimizer step; the gradients, the model's buffers (e.g. BatchNorm statistics) and
        the RNG state are restored, so the run is the same as without the probe.
        """
        from corelooper.seeding import rng_state, set_rng_state

        model, backend = loop.model, loop.backend
        loader = loop.plugins.call_provider("train_dataloader", loop=loop, dataset=loop.train_dataset)[0]
        batch = next(iter(loader))  # on the host: only the piece tried goes to the device
        rng = rng_state()
        buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
        was_training = model.training
        model.train()
        size = self.train_size or self._configured(loop, True)
        try:
            while True:
                piece = cut(batch, size)[0]
                loop.resolve_loss_type(piece)  # as the first training step would: count its items
                oom, fatal = False, None
                try:
                    self._forward_backward(loop, backend.to_device(piece), self.micro_batches_per_step(loop))
                except Exception as e:  # keep no reference: its traceback holds the activations
                    if is_oom(e):
                        oom = True
                    elif self._world == 1:
                        raise
                    else:
                        fatal = e
                loop.optimizer.zero_grad(set_to_none=True)
                failed = oom or fatal is not None
                if self._world > 1:
                    total = self._agree(loop, int(oom), fatal=fatal is not None)
                    if fatal is not None:
                        raise fatal
                    if total > self._world:
                        raise TrainingError("Another process failed in the auto_batch_size probe.")
                    failed = total > 0
                if not failed:
                    break
                free_memory(backend)
                self._shrink(loop, training=True, example=piece, cause=None)
                size = self.train_size
        finally:
            with torch.no_grad():
                for k, v in model.named_buffers():
                    if k in buffers:
                        v.copy_(buffers[k])
            set_rng_state(rng)
            model.train(was_training)
        if self.train_size is not None and loop.state.is_world_process_zero:
            log.info("auto_find_batch_size: the probe found a training micro-batch of %d.", self.train_size)

    @staticmethod
    def _forward_backward(loop, piece, num_micro_batches: int) -> None:
        """As the step's first micro-batch: the same dispatcher, the same sum/mean loss rule."""
        from corelooper.data.loader import count_loss_items
        from corelooper.step import micro_batch_loss

        with loop.backend.no_sync(loop.model):
            n = count_loss_items(piece, loop.loss_type)
            loop.backend.backward(micro_batch_loss(loop, piece, n, num_micro_batches))


def check_backend(backend) -> None:
    """A backend that fixes gradient accumulation when it is built (``fixed_accumulation``, e.g.
    DeepSpeed's engine): a smaller micro-batch could not keep the effective batch there."""
    if not getattr(backend, "fixed_accumulation", False):
        return
    raise ConfigError(
        f"train.auto_find_batch_size = true cannot work with the {type(backend).__name__} backend: "
        "it fixes the number of micro-batches per step when it is built (fixed_accumulation), so a "
        "smaller micro-batch could not keep the effective batch. Set "
        "train.auto_find_batch_size = false and choose per_device_train_batch_size / "
        "gradient_accumulation_steps by hand (or use the default DDP backend, or FSDP on one "
        "process)."
    )


def is_sharded(model) -> bool:
    """Whether parameters are sharded over processes (FSDP2/tensor parallel DTensors, FSDP1)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        DTensor = ()  # noqa: N806
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return True
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def reset_ddp_reducer(model) -> None:
    """Forget an abandoned attempt in DDP's reducer, on every process alike.

    A process that finished the forward of the step's last micro-batch has told DDP to expect
    a synchronising backward; without this reset, the next backward (even under ``no_sync``)
    would start an all-reduce the other processes never join.
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) and hasattr(model.reducer, "_reset_state"):
        model._has_rebuilt_buckets = False
        model.reducer._reset_state()


def free_memory(backend) -> None:
    gc.collect()
    device_module = getattr(torch, backend.device.type, None)
    if backend.device.type != "cpu" and hasattr(device_module, "empty_cache"):
        device_module.empty_cache()


def too_big_message(loop, training: bool, size: int, example, cause) -> str:
    model = loop.backend.unwrap_model(loop.model) if loop.backend is not None else loop.model
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = sample_shape(example) if example is not None else "sample shape unknown"
    what = "a training micro-batch" if training else "an evaluation batch"
    device = loop.backend.device if loop.backend is not None else "?"
    why = f" ({type(cause).__name__}: {str(cause).splitlines()[0][:200]})" if cause is not None else ""
    return (
        f"auto_find_batch_size: even {what} of {size} sample{'s' if size > 1 else ''} does not "
        f"fit in memory on {device} at global_step {loop.state.global_step}{why}. Model: "
        f"{params:,} parameters ({trainable:,} trainable); {shape}; mixed_precision = "
        f"{loop.args.mixed_precision!r}. Shorten the sequences (or the samples), use "
        'mixed_precision = "bf16", turn on train.gradient_checkpointing, or shard the model '
        "over devices (FSDP / DeepSpeed). The last complete checkpoint in "
        f"{loop.args.output_dir!r} is untouched."
    )
