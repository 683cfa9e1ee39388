"""Graceful stop on SIGTERM / SIGINT (preemption, ``scancel``, Ctrl-C).

While ``Loop.train()`` runs, the first SIGTERM or SIGINT is only *noted*. The loop finishes the
optimizer step it is in, writes a checkpoint, fires ``on_train_end`` with ``state.preempted =
True`` and returns; the CLI then exits with ``128 + signal number`` — **143 for SIGTERM, 130 for
SIGINT**, the shell's convention for "killed by that signal" — so job schedulers see the run did
not finish. Further signals while that happens are ignored (the save is atomic anyway;
``kill -9`` remains the hard stop and still leaves every complete checkpoint intact).

Handlers are installed only in the main thread (Python allows no other) and the previous ones
are restored when ``train()`` returns. With several processes, ranks agree on the step to stop
at with one all-reduce of a flag per optimizer step (only when ``world_size > 1``).
"""

from __future__ import annotations

import os
import signal
import threading

SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT") if hasattr(signal, name))


class Preemption:
    """Notes a stop signal; ``requested()`` tells the loop when to stop (all ranks agree)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal.signal would raise; the embedding application owns signals
        for sig in SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except (ValueError, OSError):  # e.g. an embedded interpreter that forbids it
                pass
        return self

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        # One voice: with several ranks only rank 0 speaks, and only of the first signal (Ctrl-C
        # reaches every rank, then the launcher forwards its copy); the stop is agreed by all.
        quiet = os.environ.get("RANK", "0") != "0"
        if self.signum is None:
            self.signum = signum
            if quiet:
                return
            msg = (f"\ncorelooper: {name} received: finishing this optimizer step, saving a checkpoint, "
                   "then exiting (resume with --resume-from-checkpoint latest)\n")
        else:
            if quiet or os.environ.get("WORLD_SIZE", "1") != "1":
                return
            msg = f"\ncorelooper: {name} received again: already stopping, please wait for the save\n"
        try:
            os.write(2, msg.encode())  # no buffered I/O inside a signal handler
        except OSError:
            pass

    def requested(self, backend) -> bool:
        """Whether to stop after this step. Cheap in one process (no device sync)."""
        local = self.signum is not None
        if backend.num_processes == 1:
            return local
        import torch

        flag = torch.tensor(1.0 if local else 0.0, device=backend.device)
        return bool(backend.reduce_sum(flag).item() > 0)

    @property
    def exit_code(self) -> int:
        """``128 + signum`` (143 for SIGTERM, 130 for SIGINT); 143 if stopped by another rank."""
        return 128 + (self.signum if self.signum is not None else signal.SIGTERM)


class PreemptionPlugin:
    """The builtin plugin ``preemption``: after the step in which a stop signal arrived (on any
    rank), save and stop (``state.preempted``, ``state.stop_signal``). ``-p no:preemption``
    leaves SIGTERM/SIGINT to Python's defaults."""

    def __init__(self) -> None:
        self.preemption: Preemption | None = None

    def on_train_begin(self) -> None:
        if self.preemption is None:
            self.preemption = Preemption().install()

    def on_step_end(self, loop, state, control) -> None:
        if self.preemption is not None and self.preemption.requested(loop.backend):
            state.preempted = True
            state.stop_signal = self.preemption.exit_code - 128
            control.should_save = True
            control.should_training_stop = True

    def restore(self) -> None:
        if self.preemption is not None:
            self.preemption.restore()
            self.preemption = None

    def on_train_end(self) -> None:
        self.restore()

    def on_exception(self) -> None:
        self.restore()
