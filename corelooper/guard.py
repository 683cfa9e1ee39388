"""The non-finite guard (``train.on_nonfinite``): a NaN/Inf loss or gradient norm is caught at the
step it happens.

* ``"stop"`` (default): fire ``on_nonfinite``, then end the run with a ``NonFiniteError`` naming
  the step, the micro-batch, its sample indices and the last checkpoint (nothing non-finite is
  ever saved).
* ``"skip_step"``: fire ``on_nonfinite``, zero the step's gradients, skip the optimizer and
  scheduler step (logged as ``skipped_steps``); stop after ``max_skipped_steps`` in a row.
* ``"ignore"``: no check.

Cost: on the CPU the check is one ``isfinite`` over the step's losses and the norm the clipping
computed anyway. On an accelerator, reading it would stall the host every step, so with an
optimizer that honours ``found_inf`` (torch's fused/foreach AdamW and Adam, as for AMP's
GradScaler) the skip is done on the device (``optimizer.found_inf``) and the host reads the
flag one step later, from a non-blocking copy; other optimizers (and ``skip_step``, whose
scheduler must not step) read it at once.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .errors import TrainingError


class NonFiniteError(TrainingError):
    """The loss or gradient norm became NaN/Inf (``train.on_nonfinite = "stop"``)."""


class NonFiniteGuard:
    def __init__(self, policy: str, max_skipped: int, deferred: bool, on_cpu: bool = False) -> None:
        self.policy = policy
        self.on_cpu = on_cpu
        self.max_skipped = max_skipped
        self.deferred = deferred and policy == "stop"
        self.skipped_in_row = self.skipped_total = 0
        self._pending = None  # (host flag, step, host micro_batches, losses, grad_norm)

    def check(self, loop, micro_batches: list, losses: list, step_loss, grad_norm) -> bool:
        """True: apply this step's update. False: skip it (``skip_step``). Raises on ``stop``."""
        if self.policy == "ignore":
            return True
        self.poll(loop)  # the previous step's deferred flag, if any
        # One scalar is non-finite iff a loss or the norm is. Under fp16 the grad scaler owns
        # overflowing gradients (it skips those steps and lowers the scale): the loss only then.
        fp16 = loop.args.mixed_precision == "fp16"
        if self.on_cpu and not self.deferred and loop.backend.num_processes == 1:  # reads, no kernel
            if math.isfinite(float(step_loss)) and (
                grad_norm is None or fp16 or math.isfinite(float(grad_norm))
            ):
                self.skipped_in_row = 0
                return True
            return self._handle(loop, loop.state.global_step + 1, micro_batches, losses, grad_norm)
        total = step_loss if grad_norm is None or fp16 else step_loss + grad_norm.float()
        if (grad_norm is None or fp16) and loop.backend.num_processes > 1:
            # Only the gradients are the same on every rank: agree on the losses' verdict, so
            # that no rank stops while the others wait for it in the next collective.
            total = loop.backend.reduce_sum(total.detach().clone())
        if self.deferred and not fp16:
            inner = getattr(loop.optimizer, "optimizer", loop.optimizer)  # accelerate's wrapper
            if getattr(inner, "_step_supports_amp_scaling", False):
                bad = ~torch.isfinite(total)
                inner.found_inf = bad.float()  # the fused kernel skips the update on the device
                flag = torch.empty((), dtype=torch.bool, pin_memory=bad.is_cuda)
                flag.copy_(bad, non_blocking=True)
                self._pending = (flag, loop.state.global_step + 1, micro_batches, losses, grad_norm)
                return True
        if math.isfinite(float(total)):  # on the CPU a read, not a wait
            self.skipped_in_row = 0
            return True
        return self._handle(loop, loop.state.global_step + 1, micro_batches, losses, grad_norm)

    def poll(self, loop, wait: bool = False) -> None:
        """Act on a deferred flag (``wait``: before a save, an evaluation or the end)."""
        if self._pending is None:
            return
        flag, step, micro_batches, losses, grad_norm = self._pending
        if wait and flag.is_pinned():
            torch.cuda.synchronize()
        self._pending = None
        if bool(flag):
            self._handle(loop, step, micro_batches, losses, grad_norm)

    def _handle(self, loop, step: int, micro_batches, losses, grad_norm) -> bool:
        action = self.policy
        if action == "skip_step" and self.skipped_in_row + 1 > self.max_skipped:
            action = "stop"
        indices = sample_indices(loop, len(micro_batches))
        loop.events.fire(
            "on_nonfinite",
            micro_batches=[loop.backend.to_device(b) for b in micro_batches],
            sample_indices=indices,
            loss=torch.stack(losses).sum(),
            grad_norm=grad_norm,
            action=action,
        )
        if action == "stop":
            raise NonFiniteError(stop_message(loop, step, losses, grad_norm, indices, self.skipped_in_row))
        self.skipped_in_row += 1
        self.skipped_total += 1
        return False


def sample_indices(loop, n: int) -> list[list[int]] | None:
    """Dataset indices of this process's micro-batches of the current step, when the loader
    can tell (the builtin map-style loader can)."""
    batch_indices = getattr(loop.train_loader, "batch_indices", None)
    if not callable(batch_indices):
        return None
    start = loop.state.micro_batches_in_epoch
    return [list(map(int, b)) for b in batch_indices()[start : start + n]]


def stop_message(loop, step: int, losses, grad_norm, indices, skipped: int) -> str:
    bad = [i for i, loss in enumerate(losses) if not torch.isfinite(loss)]
    where = (
        f"the loss of micro-batch {bad[0]} of {len(losses)}"
        if bad
        else f"the gradient norm ({float(grad_norm)}) with finite losses"
    )
    samples = f" (samples {indices[bad[0] if bad else 0][:16]})" if indices else ""
    from .checkpoints.run_dir import last_finite_checkpoint

    found = last_finite_checkpoint(Path(loop.args.output_dir))
    last = (
        f"the last checkpoint, {found}, was saved before it, verifies and is finite"
        if found
        else "no checkpoint was written yet"
    )
    after = f" after {skipped} skipped steps in a row (train.max_skipped_steps)" if skipped else ""
    return (
        f"Non-finite values at global_step {step}{after}: {where}{samples} is NaN/Inf. Nothing "
        f"non-finite was saved; {last}. Lower train.learning_rate, set train.max_grad_norm, use "
        "bf16 instead of fp16, check the data of those samples, or set train.on_nonfinite = "
        '"skip_step" to skip such steps. A diagnosis plugin (on_nonfinite; `corelooper plugins`) can '
        "name the module."
    )
