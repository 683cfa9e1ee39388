"""The logging window: what the loop sums between two logs, and the run's summary.

The window's loss stays on the device (a running sum of detached step losses, added in step
order so that a resumed window sums exactly as an uninterrupted one); it is read, with one host
sync, only when a log is written or a checkpoint saves the window.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from .data.loader import count_tokens_seen


class LogWindow:
    """Sums of loss, steps, samples and tokens since the last log."""

    def __init__(self, device) -> None:
        self.device = device
        self.skipped_seen = 0  # the guard's count of skipped steps at the last add
        self.reset()

    def reset(self) -> None:
        self.loss = torch.zeros((), device=self.device)
        self.steps = self.samples = self.tokens = 0
        self.skipped = 0  # steps the non-finite guard skipped (on_nonfinite = "skip_step")
        self.start, self.untimed = time.perf_counter(), (0, 0)  # untimed: samples, tokens before a resume

    def add(self, step_loss: torch.Tensor, samples: int, tokens: int, skipped_total: int = 0) -> None:
        """``skipped_total``: the non-finite guard's count of skipped steps, so far."""
        skipped, self.skipped_seen = skipped_total > self.skipped_seen, skipped_total
        if skipped:  # its NaN loss is not averaged in: the window's loss is the applied steps'
            self.skipped += 1
        else:
            self.loss += step_loss
        self.steps += 1
        self.samples += samples
        self.tokens += tokens

    def logs(self, backend, grad_norm, learning_rate: float, epoch: float) -> dict[str, Any]:
        """The log of this window (HF's keys), in the order HF writes them."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        loss = backend.reduce_mean(self.loss).item() / max(self.steps - self.skipped, 1)
        logs: dict[str, Any] = {}
        if self.steps > self.skipped:  # a window of skipped steps only has no loss to log
            logs["loss"] = round(loss, 6) if math.isfinite(loss) else loss
        if grad_norm is not None:
            logs["grad_norm"] = float(grad_norm)
        logs["learning_rate"] = learning_rate
        logs["epoch"] = round(epoch, 4)
        logs["samples_per_second"] = round((self.samples - self.untimed[0]) / elapsed, 2)
        if self.tokens:
            logs["tokens_per_second"] = round((self.tokens - self.untimed[1]) / elapsed, 2)
        return logs

    # -- checkpointed (so the first log after a resume averages the same steps) --------------
    def state_dict(self) -> dict[str, Any] | None:
        if not self.steps:
            return None
        return {
            "loss": float(self.loss),
            "steps": self.steps,
            "samples": self.samples,
            "tokens": self.tokens,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.reset()
        if state:
            self.loss += state["loss"]
            self.steps, self.samples, self.tokens = state["steps"], state["samples"], state["tokens"]
            self.skipped, self.untimed = state.get("skipped", 0), (self.samples, self.tokens)


class TokensSeen:
    """HF's ``include_num_input_tokens_seen`` ("all", "non_padding", "no"), counted on the
    fetched (host) batches; summed over processes only when logged or saved, so no step waits
    for a collective. Data without the model's main input (no ``input_ids``: images, tabular
    rows) has no tokens to count: the key is then left out of the logs rather than logged as 0."""

    def __init__(self, mode: str, pad_token_id: int | None, main_input: str) -> None:
        self.mode, self.pad_token_id, self.main_input = mode, pad_token_id, main_input
        self.pending = 0  # this process's tokens not yet in state.num_input_tokens_seen
        self.token_data = False  # a batch with the main input was seen

    @property
    def logged(self) -> bool:
        """Whether logs carry ``num_input_tokens_seen``."""
        return self.mode != "no" and self.token_data

    def add(self, micro_batches: list) -> None:
        if self.mode == "no":
            return
        if not self.token_data:
            first = micro_batches[0] if micro_batches else None
            self.token_data = isinstance(first, dict) and self.main_input in first
        self.pending += int(
            count_tokens_seen(micro_batches, self.mode, None, self.pad_token_id, self.main_input)
        )

    def flush(self, backend, state) -> None:
        pending, self.pending = self.pending, 0
        if state.world_size > 1:
            pending = int(backend.reduce_sum(torch.tensor(pending, device=backend.device)).item())
        state.num_input_tokens_seen += pending


def run_summary(log_history: list[dict], runtime: float, steps: int, samples: int) -> dict[str, Any]:
    """``train_runtime``, ``train_steps_per_second``, ``train_samples_per_second``, ``train_loss``.

    ``train_loss`` is the mean over every applied optimizer step, as HF's: each logged window
    loss counts for the number of steps it averaged (windows differ, e.g. the last one); steps
    the non-finite guard skipped (the logs' running ``skipped_steps``) count for nothing.
    """
    weighted, applied, prev_step, prev_skipped = 0.0, 0, 0, 0
    for h in log_history:
        if "loss" not in h and "skipped_steps" not in h:
            continue  # an evaluation's or a plugin's log, not a training window
        skipped = h.get("skipped_steps", 0)
        prev_skipped = min(prev_skipped, skipped)  # the count starts again after a resume
        n = (h["step"] - prev_step) - (skipped - prev_skipped)
        if "loss" in h:
            weighted, applied = weighted + h["loss"] * n, applied + n
        prev_step, prev_skipped = h["step"], skipped
    return {
        "train_runtime": round(runtime, 4),
        "train_steps_per_second": round(steps / max(runtime, 1e-9), 3),
        "train_samples_per_second": round(samples / max(runtime, 1e-9), 3),
        "train_loss": weighted / applied if applied else float("nan"),
    }
