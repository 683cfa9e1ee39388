"""``token_accuracy`` in the training logs: the share of trained tokens whose argmax prediction is
their label, over the logging window (TRL's SFT trainer logs ``mean_token_accuracy``); with
``[lm] entropy``, ``entropy``: the mean over the same tokens of the predicted distribution's
entropy in nats (TRL's ``entropy``).

The loss provider (``LMLoss``, or ``compute_loss`` here around another plugin's loss) hands each
training micro-batch's logits and targets to ``add``, which counts on the device: no host sync per
step. At a step that logs or saves, and when training stops (the loop then logs what is left of
the window), every process sums its counts into the run's: one collective, on every process
(``on_step_end``, ``on_epoch_end`` and ``on_evaluate`` fire on each). The main process puts the
window's value into the training log.

Token-weighted over the window and over processes: TRL appends one value per micro-batch
(correct over counted, gathered over processes) and logs their mean, which equals this with one
micro-batch per logged step, and weighs short micro-batches up otherwise. The entropy costs a
log-softmax over the counted logits (about the loss's own cost again), so it is asked for.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from corelooper import hookimpl

from . import others_provide_loss

KEY = "token_accuracy"
ENTROPY = "entropy"
ENTROPY_CHUNK = 1 << 24  # float32 logits per piece of the entropy (64 MiB), as TRL's 128-row chunks


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Each position's entropy in nats, TRL's ``entropy_from_logits`` (``-(p * log p).sum(-1)``),
    in float32, a piece of rows at a time (no float32 copy of all of a large vocabulary's logits)."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    pieces = [
        _entropy_rows(piece.float()) for piece in flat.split(max(1, ENTROPY_CHUNK // max(vocab, 1)), dim=0)
    ]
    return (
        torch.cat(pieces).reshape(logits.shape[:-1]) if pieces else flat.new_zeros(logits.shape[:-1]).float()
    )


def _entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    """``log Z - sum(e * s) / Z`` with ``s = z - max z``, ``e = exp(s)``, ``Z = sum(e)``: one
    exponential pass (a log-softmax and its ``exp`` take two), and a token a ``-inf`` logit rules
    out adds nothing (``0 * -inf``: 0) where TRL's formula turns the row into NaN."""
    shifted = logits - logits.amax(-1, keepdim=True)
    weights = shifted.exp()
    total = weights.sum(-1)
    return total.log() - shifted.mul_(weights).nan_to_num_(0.0).sum(-1) / total


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``, the same indices (the first maximum, as TRL's ``is_top1``). On the
    CPU, where ``argmax`` over the last dimension runs ~20x slower than ``amax`` (746 vs 31 µs for
    450 x 2,048 floats), in two levels: the first block of ``width`` logits holding the row's
    maximum, then the first maximum inside it (186 µs)."""
    vocab = logits.shape[-1]
    width = 1 << max(0, (vocab.bit_length() - 1) // 2)  # a power of two near sqrt(vocab)
    while width >= 16 and vocab % width:
        width //= 2
    if logits.device.type != "cpu" or width < 16 or logits.dim() < 1 or logits.numel() == 0:
        return logits.argmax(-1)
    flat = logits.reshape(-1, vocab // width, width)
    block = flat.amax(-1).argmax(-1)
    inner = flat[torch.arange(flat.shape[0]), block].argmax(-1)
    return (block * width + inner).reshape(logits.shape[:-1])


class TrainTokenAccuracy:
    """Counts of the current window; checkpointed (``register_for_checkpointing``) so that the first
    log after a resume covers the same steps as an uninterrupted run's."""

    def __init__(self, accuracy: bool = True, entropy: bool = False) -> None:
        self.keys = [key for key, on in ((KEY, accuracy), (ENTROPY, entropy)) if on]
        self.local: torch.Tensor | None = None  # [correct, counted] on the device, this process only
        self.local_entropy: torch.Tensor | None = None  # the counted tokens' entropies summed, ditto
        self.carried = [0, 0, 0.0]  # [correct, counted, entropy] summed over processes already
        self.pending: dict[str, float] = {}  # for the next training log (main process)

    def add(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """``logits``: ``[..., vocab]``; ``targets``: the label each position predicts (-100: not
        counted), shaped like ``logits[..., 0]``."""
        with torch.no_grad():
            targets = targets.to(logits.device)
            counted = targets != -100
            total = counted.sum()
            hits = (
                ((argmax(logits) == targets) & counted).sum() if KEY in self.keys else torch.zeros_like(total)
            )
            counts = torch.stack([hits, total])
            self.local = counts if self.local is None else self.local + counts
            if ENTROPY in self.keys:  # float64 sums where the device has them (not MPS)
                wide = torch.float32 if logits.device.type == "mps" else torch.float64
                summed = torch.where(counted, entropy(logits), 0.0).sum(dtype=wide)
                self.local_entropy = summed if self.local_entropy is None else self.local_entropy + summed

    def counted(self, answer, batch):
        """The loss of a provider's ``(loss, outputs)`` answer, once the outputs' logits are counted
        against the batch's causal targets (nothing is counted where the outputs hold no logits, as
        with Liger's fused loss, or logits the labels do not line up with)."""
        from .trained_head import causal_targets

        if not isinstance(answer, tuple):
            return answer
        loss, outputs = answer
        logits = outputs.get("logits") if isinstance(outputs, Mapping) else getattr(outputs, "logits", None)
        if (
            isinstance(batch, Mapping)
            and ("labels" in batch or "shift_labels" in batch)
            and logits is not None
        ):
            targets = causal_targets(batch)
            if tuple(targets.shape) == tuple(logits.shape[:-1]):
                self.add(logits, targets)
        return loss

    @hookimpl(tryfirst=True)
    def compute_loss(self, loop, model, batch, num_items_in_batch, return_outputs):
        """Another plugin's training loss (a per-sample weighted loss): asked for its outputs too,
        whose logits are counted. corelooper-lm's own loss and the builtin one count in ``LMLoss``."""
        if return_outputs or not model.training or not torch.is_grad_enabled():
            return None
        if not others_provide_loss(loop):
            return None
        return self.next_loss(self, loop, model, batch, num_items_in_batch)

    compute_loss.corelooper_role = "wraps"  # another plugin's loss, passed on: `corelooper plugins` lists it

    def next_loss(self, after, loop, model, batch, num_items_in_batch):
        """The loss of the ``compute_loss`` provider after plugin object ``after``, asked for its
        outputs too, once their logits are counted."""
        answer = loop.plugins.call_next(
            "compute_loss",
            after,
            loop=loop,
            model=model,
            batch=batch,
            num_items_in_batch=num_items_in_batch,
            return_outputs=True,
        )[0]
        return self.counted(answer, batch)

    @hookimpl(trylast=True)  # after the flow and other plugins have decided should_log / should_save
    def on_step_end(self, loop, control) -> None:
        self._at_boundary(loop, control)

    @hookimpl(trylast=True)
    def on_epoch_end(self, loop, control) -> None:
        self._at_boundary(loop, control)

    @hookimpl(trylast=True)
    def on_evaluate(self, loop, control) -> None:
        if (
            control.should_training_stop
        ):  # stopped by an evaluation (early stopping): the last window is logged
            self._fold(loop, publish=True)

    def _at_boundary(self, loop, control) -> None:
        # should_training_stop: the loop logs what is left of the window when training ends
        publish = control.should_log or control.should_training_stop
        if publish or control.should_save:
            self._fold(loop, publish)

    def _fold(self, loop, publish: bool) -> None:
        """Sum this window's counts over processes (a collective: every process calls it at the same
        step); ``publish``: they are the next training log's value."""
        backend = loop.backend
        local = self.local if self.local is not None else torch.zeros(2, dtype=torch.int64)
        correct, counted = backend.reduce_sum(local.to(backend.device)).tolist()
        summed = 0.0
        if ENTROPY in self.keys:
            local = (
                self.local_entropy if self.local_entropy is not None else torch.zeros((), dtype=torch.float32)
            )
            summed = float(backend.reduce_sum(local.to(backend.device)))
        self.local, self.local_entropy = None, None
        self.carried = [
            self.carried[0] + int(correct),
            self.carried[1] + int(counted),
            self.carried[2] + summed,
        ]
        if publish and self.carried[1]:  # (an empty fold, as at the epoch end after a stop, keeps the value)
            correct, counted, summed = self.carried
            self.pending = {key: (correct if key == KEY else summed) / counted for key in self.keys}
            self.carried = [0, 0, 0.0]

    @hookimpl
    def on_train_begin(self) -> None:
        self.local, self.local_entropy, self.pending = None, None, {}  # a second train() starts clean

    @hookimpl(tryfirst=True)  # before the loggers read the log
    def on_log(self, logs: dict) -> None:
        if "learning_rate" in logs and "loss" in logs:  # a training window's log, not an evaluation's
            logs.update(self.pending)
            self.pending = {}

    def state_dict(self) -> dict[str, float]:
        return {"correct": self.carried[0], "counted": self.carried[1], "entropy": self.carried[2]}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.local, self.local_entropy, self.pending = None, None, {}
        self.carried = [
            int(state.get("correct", 0)),
            int(state.get("counted", 0)),
            float(state.get("entropy", 0.0)),
        ]
