"""Model outputs: collect them (``eval_accumulation_steps``) and gather them across processes in
dataset order (their files: ``cli/predictions.py``).

Order: the evaluation loader gives each process a contiguous block of the dataset (rank 0 the
first), so concatenating the gathered blocks in rank order restores dataset order with no
duplicates. Outputs whose trailing sizes differ between batches or processes (sequences of
different lengths) are padded with -100, as HF does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

PAD = -100


@dataclass(frozen=True)
class LogitsWanted:
    """``compute_loss``'s ``return_outputs`` when only a metric with ``preprocess_logits`` reads the
    outputs. Truthy: a provider that ignores it returns the outputs (the evaluation preprocesses
    them); one that knows it may return ``(loss, Preprocessed(preprocess(logits)))``, computed a
    slice of positions at a time. ``counted_only``: only positions whose causal target counts
    (``labels[t + 1]`` or ``shift_labels[t]`` not -100) are read; others may hold PAD (or NaN)."""

    preprocess: Callable[[torch.Tensor], torch.Tensor] | None  # None: the loss alone (a provider's own use)
    counted_only: bool = False


@dataclass(frozen=True)
class Preprocessed:
    """A loss provider's answer to ``LogitsWanted``: the metric's predictions, already preprocessed."""

    predictions: torch.Tensor


def _pad_to(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(t.shape[1:]) == tuple(shape):
        return t
    out = t.new_full((t.shape[0], *shape), PAD)
    out[(slice(None), *(slice(0, s) for s in t.shape[1:]))] = t
    return out


def concat_padded(chunks: list[torch.Tensor]) -> torch.Tensor:
    if len(chunks) == 1:
        return chunks[0]
    shape = tuple(max(c.shape[d] for c in chunks) for d in range(1, chunks[0].dim()))
    return torch.cat([_pad_to(c, shape) for c in chunks])


class OutputAccumulator:
    """Model outputs and labels of one process during ``evaluate``/``predict``.

    They stay on the device and are moved to the CPU every ``steps`` batches (HF's
    ``eval_accumulation_steps``; ``None``: once, at the end), so the device holds at most
    ``steps`` batches of outputs and the host syncs once per chunk, not per batch.
    """

    def __init__(self, steps: int | None = None):
        self.steps = steps
        self._preds: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []
        self._cpu_preds: list[torch.Tensor] = []
        self._cpu_labels: list[torch.Tensor] = []
        self._parts: list[OutputAccumulator] | None = None  # one per output when a batch gives several

    def __bool__(self) -> bool:
        return bool(self._preds or self._cpu_preds or self._parts)

    def add(self, predictions, labels: torch.Tensor | None) -> None:
        """``predictions``: a tensor, or a tuple of them (several model outputs, as HF keeps them)."""
        if isinstance(predictions, (tuple, list)):
            if self._parts is None:
                self._parts = [OutputAccumulator(self.steps) for _ in predictions]
            for part, p in zip(self._parts, predictions, strict=True):
                part.add(p, None)
        else:
            self._preds.append(predictions.detach().float())
        if labels is not None:
            self._labels.append(labels.detach())
        if self.steps and max(len(self._preds), len(self._labels)) >= self.steps:
            self._offload()

    def _offload(self) -> None:
        if self._preds:
            self._cpu_preds.append(concat_padded(self._preds).cpu())
        if self._labels:
            self._cpu_labels.append(concat_padded(self._labels).cpu())
        self._preds, self._labels = [], []

    def local(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        self._offload()
        preds = concat_padded(self._cpu_preds) if self._cpu_preds else None
        labels = concat_padded(self._cpu_labels) if self._cpu_labels else None
        return preds, labels

    def gather(self, backend) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Every process's outputs, in rank order (= dataset order), on the CPU of every process."""
        preds, labels = self.local()
        if self._parts:
            preds = tuple(part.gather(backend)[0] for part in self._parts)
            return preds, _gather(labels, backend)
        return _gather(preds, backend), _gather(labels, backend)


def _gather(t: torch.Tensor | None, backend) -> torch.Tensor | None:
    if t is None:
        return None
    if backend.num_processes > 1 and t.dim() > 1:
        shape = torch.tensor(t.shape[1:], device=backend.device)
        dist.all_reduce(shape, op=dist.ReduceOp.MAX)
        t = _pad_to(t, tuple(int(s) for s in shape.tolist()))
    return backend.gather(t.to(backend.device)).cpu()
