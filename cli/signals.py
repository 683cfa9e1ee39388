"""Stop signals while the CLI starts a run or has finished one: one paragraph, exit 75 / 76.

Inside ``Loop.train`` the builtin ``preemption`` plugin's graceful handlers save a checkpoint; outside
it (loading the model, tokenising, the final export) there is nothing to save, and a signal
must end the command with its own exit code, not a traceback. Only the CLI needs this: a
library user's process keeps its own handlers.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from corelooper.builtin.preemption import SIGNALS

NO_CHECKPOINT_EXIT = {getattr(signal, "SIGTERM", 15): 75, getattr(signal, "SIGINT", 2): 76}


class StartupStop(BaseException):  # noqa: N818 - like KeyboardInterrupt: not an error, a stop
    """A stop signal outside ``train()``: nothing to save; ``exit_code`` is 75 / 76."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.exit_code = NO_CHECKPOINT_EXIT.get(signum, 75)

    def __str__(self) -> str:
        return (
            f"{signal.Signals(self.signum).name} received outside training: stopped, no checkpoint "
            "written by this stop"
        )


_STOPPED: list[int] = []  # the signal that stopped start-up: kept, as a library may swallow the exception
_previous_hook = [sys.unraisablehook]  # the unraisable hook before ours (a test runner's), for the rest


def _startup_handler(signum: int, frame) -> None:
    # The first signal stops start-up; later ones (schedulers and launchers send several, ms
    # apart) are ignored, at the C level: a Python handler would raise a second StartupStop in the
    # middle of the exit (or in an atexit callback), and one reset by interpreter shutdown would
    # end the process -15 after it said "Exit 75". One paragraph, one exit code.
    for sig in SIGNALS:
        try:
            signal.signal(sig, signal.SIG_IGN)
        except (ValueError, OSError):
            pass
    _STOPPED.append(signum)
    raise StartupStop(signum)


def pending_stop() -> StartupStop | None:
    """The stop whose ``StartupStop`` never reached the command: a library swallowed it (a bare
    ``except:`` around an import, which may then fail otherwise) -- None when there was none. The
    command reports it instead of what followed, or raises it again where it checks."""
    return StartupStop(_STOPPED[0]) if _STOPPED else None


def _unraisable(info) -> None:
    """A ``StartupStop`` raised inside a weakref callback or a ``__del__`` (Python prints such an
    exception as "Exception ignored" and goes on): the command stops there, with its one line."""
    if not isinstance(info.exc_value, StartupStop):
        return _previous_hook[0](info)
    if os.environ.get("RANK", "0") == "0":
        print(f"corelooper: {info.exc_value}. Exit {info.exc_value.exit_code}.", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(info.exc_value.exit_code)  # nothing is being written at start-up; the lock dies with us


def install_startup_handlers() -> None:
    """SIGTERM/SIGINT raise ``StartupStop`` until ``Loop.train`` installs its graceful handlers
    (and again after it restores them)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if sys.unraisablehook is not _unraisable:
        _previous_hook[0], sys.unraisablehook = sys.unraisablehook, _unraisable
    for sig in SIGNALS:
        try:
            signal.signal(sig, _startup_handler)
        except (ValueError, OSError):
            pass
