"""Where the wall time of a logging window went: data, forward, backward, optimizer, hooks.

The events give the boundaries (``on_step_begin`` fires once the step's micro-batches were
fetched; ``on_before_backward``/``on_after_backward`` around each backward;
``on_pre_optimizer_step``/``on_optimizer_step`` around the optimizer; ``on_step_end``). Time spent
inside plugin event hooks (all plugins' ``on_*`` implementations, the doctor's included) is
measured around each event dispatch and carved out of the phase it fell into, so the shares add
up.

Host clock only, no device sync: on CUDA, device work that the host does not wait for shows up
where the host next waits (usually the optimizer step or the logging sync), and "data" may
overlap device compute, so the input-bound warning is an upper bound there.
"""

from __future__ import annotations

import time

PHASES = ("data", "forward", "backward", "optimizer", "hooks", "other")


class HookTimer:
    """Time inside event dispatches (every plugin's ``on_*`` implementations); only grows.

    Measured with pluggy's hook-call monitoring around each event call rather than by wrapping
    implementations: wrapped functions would hide which plugin raised (the loop names the
    plugin from the implementation's code object in the traceback).
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started: list[float] = []
        self._undo = None

    def install(self, plugins) -> None:
        clock, started = time.perf_counter, self._started

        def before(hook_name, hook_impls, kwargs):
            if hook_name.startswith("on_"):
                started.append(clock())

        def after(outcome, hook_name, hook_impls, kwargs):
            if hook_name.startswith("on_") and started:
                self.seconds += clock() - started.pop()

        self._undo = plugins.pm.add_hookcall_monitoring(before, after)

    def uninstall(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None


class PhaseClock:
    """Accumulates per-phase seconds between event timestamps, hook time carved out."""

    def __init__(self, hooks: HookTimer) -> None:
        self.hooks = hooks
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.phase = "other"
        self._t = time.perf_counter()
        self._h = hooks.seconds
        self._window_start = self._t
        self.steps = 0
        self.step_started = self._t

    def mark(self, next_phase: str) -> None:
        """The current phase ends now; ``next_phase`` starts."""
        t, h = time.perf_counter(), self.hooks.seconds
        in_hooks = h - self._h
        self.totals[self.phase] += max(0.0, (t - self._t) - in_hooks)
        self.totals["hooks"] += in_hooks
        self.phase, self._t, self._h = next_phase, t, h

    def window(self) -> dict[str, float]:
        """Shares of the window's wall time per phase; starts the next window."""
        self.mark(self.phase)
        now = time.perf_counter()
        wall = max(now - self._window_start, 1e-9)
        shares = {p: self.totals[p] / wall for p in PHASES}
        self.totals = dict.fromkeys(PHASES, 0.0)
        self._window_start = now
        return shares


def timing_logs(shares: dict[str, float]) -> dict[str, float]:
    return {f"time_share_{p}": round(s, 4) for p, s in shares.items()}


def input_bound_warning(shares: dict[str, float], threshold: float) -> str | None:
    if shares.get("data", 0.0) <= threshold:
        return None
    return (
        f"doctor: {100 * shares['data']:.0f}% of this window's wall time was spent waiting for "
        "data (the run is input-bound): raise train.dataloader_num_workers, pre-tokenize, or pack "
        "sequences."
    )
