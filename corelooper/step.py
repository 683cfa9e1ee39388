"""The optimizer step: ``default_training_step`` is the builtin ``training_step`` provider.

Read it as nanoGPT's step: fetch -> count the loss-bearing items -> for each micro-batch (to the
device; ``no_sync`` on all but the last) ``compute_loss`` -> backward -> clip -> non-finite guard ->
optimizer step -> scheduler -> ``zero_grad``. A plugin may replace it (``training_step``) or
wrap it (``plugins.call_next``: auto batch size retries it with smaller micro-batches).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from .data.loader import count_loss_items
from .gradients import zero_grad
from .losses import reads_num_items


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did, returned by the ``training_step`` provider (the step writes
    nothing on the Loop). ``loss``: the step's loss, detached, on the device (no host sync);
    ``grad_norm``: the norm before clipping (logged, as HF 5.x; ``None`` when not computed);
    ``learning_rate``: the rate the optimizer step used (``None``: no update, a skipped step);
    ``num_micro_batches``: the micro-batches it ran (more than fetched when a provider cut them)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor | None = None
    learning_rate: float | None = None
    num_micro_batches: int = 1


def as_step_result(result, fetched: int) -> StepResult:
    """A provider's answer as a StepResult: the older ``(loss, grad_norm)`` tuple is accepted
    (no learning rate: the scheduler's is logged; ``fetched`` micro-batches)."""
    if isinstance(result, StepResult):
        return result
    loss, grad_norm = result
    return StepResult(loss, grad_norm, None, fetched)


def default_training_step(loop, micro_batches: list) -> StepResult:
    """One optimizer step over ``micro_batches``: the loss is the mean over the step's items,
    the same as one big batch."""
    backend, model = loop.backend, loop.model
    num_items = num_items_in_batch(loop, micro_batches)  # counted on the host: no device copy yet
    losses = []
    for i, host_batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        batch = backend.to_device(host_batch)  # one at a time: smaller pieces hold less device memory
        with nullcontext() if last else backend.no_sync(model):
            loss = micro_batch_loss(loop, batch, num_items, len(micro_batches))
            loop.events.fire("on_before_backward", loss=loss)
            backend.backward(loss)
            loop.events.fire("on_after_backward", loss=loss)
        if not last:
            loop.events.fire("on_substep_end")
        losses.append(loss.detach())
    return finish_step(loop, micro_batches, losses)


def finish_step(loop, micro_batches: list, losses: list) -> StepResult:
    """The step after its micro-batches' backward: clip -> non-finite guard -> optimizer step ->
    scheduler -> ``zero_grad``. ``losses``: each micro-batch's detached share of the step loss.
    A ``training_step`` provider that runs its micro-batches its own way (a drop-in HF
    ``Trainer.training_step`` per micro-batch) ends its step with this, as the builtin does."""
    backend, optimizer, model = loop.backend, loop.optimizer, loop.model
    step_loss = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
    max_norm = loop.args.max_grad_norm  # the norm before clipping is logged (HF 5.x); 0: nothing scaled
    grad_norm = backend.clip_grad_norm(model, max_norm if max_norm > 0 else float("inf"))
    if not loop.guard.check(loop, micro_batches, losses, step_loss, grad_norm):
        zero_grad(optimizer, model)  # skip_step: no update, no scheduler step
        return StepResult(step_loss, grad_norm, None, len(micro_batches))
    loop.events.fire("on_pre_optimizer_step", optimizer=optimizer)
    backend.optimizer_step(optimizer)
    loop.events.fire("on_optimizer_step", optimizer=optimizer)
    learning_rate = loop.scheduler.get_last_lr()[0]  # the rate this step used: logged (HF 5.x)
    loop.scheduler.step()
    zero_grad(optimizer, model)
    # Each rank's step_loss is world * (its items' loss sum) / (global items): the mean over
    # ranks (reduce_mean when logging) is the global loss, as in one process.
    return StepResult(step_loss, grad_norm, learning_rate, len(micro_batches))


def micro_batch_loss(loop, batch, num_items, num_micro_batches: int) -> torch.Tensor:
    """The ``compute_loss`` provider's loss of one micro-batch, as its share of the step's
    gradient (the sum/mean rule; auto batch size's probe applies it too)."""
    loss, answered = loop.plugins.call_provider(
        "compute_loss",
        loop=loop,
        model=loop.model,
        batch=batch,
        num_items_in_batch=num_items,
        return_outputs=False,
    )
    if "num_items_in_batch" not in answered.argnames:
        return loss / num_micro_batches  # the provider that answered returns a mean
    if loop.backend.num_processes > 1:
        return loss * loop.backend.num_processes  # DDP averages gradients over ranks
    return loss


def num_items_in_batch(loop, micro_batches: list) -> torch.Tensor | None:
    """Loss-bearing items of the whole optimizer step, over micro-batches and processes; None
    when only the builtin loss would get it and it does not read it (``reads_num_items``)."""
    loss_type = loop.resolve_loss_type(micro_batches[0])
    whole_step = len(micro_batches) == 1 and loop.backend.num_processes == 1
    if loop.plugins.only_builtin("compute_loss") and not reads_num_items(loop, micro_batches[0], whole_step):
        return None
    counts = [count_loss_items(b, loss_type) for b in micro_batches]
    total = torch.as_tensor(sum(counts[1:], counts[0]))
    if loop.backend.num_processes > 1:  # the collective runs on the device
        total = loop.backend.reduce_sum(total.to(loop.backend.device, non_blocking=True))
    # a step with no loss tokens has loss 0, not NaN (on the host the test is free: no clamp kernel)
    total = total.clamp(min=1) if total.device.type != "cpu" or int(total) < 1 else total
    return total.to(loop.backend.device, non_blocking=True)
