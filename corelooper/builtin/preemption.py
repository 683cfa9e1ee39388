"""Graceful stop on SIGTERM / SIGINT (preemption, ``scancel``, Ctrl-C).

While ``Loop.train()`` runs, the first SIGTERM or SIGINT is only *noted*. The loop finishes the
optimizer step it is in, writes a checkpoint, fires ``on_train_end`` with ``state.preempted =
True`` and returns; the CLI then exits with ``128 + signal number`` — **143 for SIGTERM, 130 for
SIGINT**, the shell's convention for "killed by that signal" — so job schedulers see the run did
not finish. Further signals while that happens are ignored (the save is atomic anyway;
``kill -9`` remains the hard stop and still leaves every complete checkpoint intact).

**Before training** (``corelooper run`` installs ``corelooper.cli.signals`` handlers first thing,
before the config is read or torch imported), a SIGTERM/SIGINT stops start-up at once: nothing
was trained, so no checkpoint is written and the exit code says so — **75 for SIGTERM, 76 for
SIGINT** (distinct from 143/130, which always mean "a checkpoint was written"). The same codes
are used for a signal after training returned (final evaluation, teardown).

Handlers are installed only in the main thread (Python allows no other) and the previous ones
are restored when ``train()`` returns. With several processes, ranks agree on the step to stop
at with one all-reduce of a flag per optimizer step (only when ``world_size > 1``): on the CPU
read at once; on GPUs read two steps later from a non-blocking copy, so no step waits for the
device (the stop then comes two steps after the signal).

``CORELOOPER_STOP_SIGNALS`` (e.g. ``SIGUSR1``, comma-separated) adds signals that stop the same
way: schedulers warn a job before its time limit or a preemption with one (Slurm's
``--signal=USR1@120``; a cluster plugin's job script sets it). Exit status ``128 + signal``.
"""

from __future__ import annotations

import os
import signal
import threading

SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT") if hasattr(signal, name))
STOP_SIGNALS_ENV = "CORELOOPER_STOP_SIGNALS"


def stop_signals() -> tuple[int, ...]:
    """SIGTERM, SIGINT and those named in ``CORELOOPER_STOP_SIGNALS`` ("SIGUSR1" or "USR1")."""
    from ..errors import ConfigError

    extra = []
    for name in filter(None, (n.strip().upper() for n in os.environ.get(STOP_SIGNALS_ENV, "").split(","))):
        sig = getattr(signal, name if name.startswith("SIG") else f"SIG{name}", None)
        if not isinstance(sig, signal.Signals) or name.startswith("SIG_"):
            raise ConfigError(
                f"{STOP_SIGNALS_ENV}={os.environ[STOP_SIGNALS_ENV]!r}: {name!r} is not a signal of this "
                "system. Use names such as SIGUSR1 or SIGUSR2, comma-separated."
            )
        extra.append(sig)
    return tuple(dict.fromkeys((*SIGNALS, *extra)))


ACCELERATOR_LAG = 2  # steps between a flag's reduction and its read, with several processes on GPUs


class Preemption:
    """Notes a stop signal; ``requested()`` tells the loop when to stop (all ranks agree)."""

    def __init__(self, lag: int = 0) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self.lag = lag  # 0 on the CPU (read at once), ACCELERATOR_LAG on an accelerator
        self._pending: list = []

    def install(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal.signal would raise; the embedding application owns signals
        for sig in stop_signals():
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
            msg = (
                f"\ncorelooper: {name} received: finishing this optimizer step, saving a checkpoint, "
                "then exiting (resume with --resume-from-checkpoint latest)\n"
            )
        else:
            if quiet or os.environ.get("WORLD_SIZE", "1") != "1":
                return
            msg = f"\ncorelooper: {name} received again: already stopping, please wait for the save\n"
        try:
            os.write(2, msg.encode())  # no buffered I/O inside a signal handler
        except OSError:
            pass

    def requested(self, backend) -> bool:
        """Whether to stop after this step; every rank answers the same at the same step.

        One process: the flag itself. Several on the CPU (gloo): one all-reduce of the flag per
        step, a host operation. On an accelerator reading a reduced flag at once would stall the
        host every step, so each step's flag is reduced asynchronously and copied to pinned host
        memory, and the decision at step k reads the flag of step k - ``lag``: already there,
        so the read costs no wait, and all ranks read the same flag (the stop comes ``lag``
        steps after the signal)."""
        local = self.signum is not None
        if backend.num_processes == 1:
            return local
        import torch

        flag = torch.tensor(1.0 if local else 0.0, device=backend.device)
        import torch.distributed as dist

        if backend.device.type == "cpu" and not self.lag:
            dist.all_reduce(flag)
            return bool(flag > 0)
        return self._lagged(flag, torch, dist)

    def _lagged(self, flag, torch, dist) -> bool:
        work = dist.all_reduce(flag, async_op=True)
        host = torch.empty((), pin_memory=flag.is_cuda)
        if flag.is_cuda:
            work.wait()  # the stream waits, not the host
            host.copy_(flag, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            work.wait()
            host.copy_(flag)
            done = None
        self._pending.append((host, done))
        if len(self._pending) <= max(self.lag, 1):
            return False
        host, done = self._pending.pop(0)
        if done is not None:
            done.synchronize()  # recorded `lag` steps ago: long finished
        return bool(host > 0)

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

    def on_train_begin(self, loop) -> None:
        if self.preemption is None:
            lag = 0 if loop.backend.device.type == "cpu" else ACCELERATOR_LAG
            self.preemption = Preemption(lag).install()

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
