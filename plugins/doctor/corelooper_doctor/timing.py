"""Where the wall time of a logging window went: data, forward, backward, optimizer, hooks.

The events give the boundaries, one clock read each: ``on_step_begin`` (the step's micro-batches
were fetched: data ends, forward starts), ``on_before_backward`` (forward ends), ``on_substep_end``
(a micro-batch's backward ended, the next forward starts; only with gradient accumulation),
``on_pre_optimizer_step`` (backward, gradient clipping and the non-finite check end; the
optimizer starts) and ``on_step_end`` (optimizer step, scheduler and ``zero_grad`` end). Logging,
evaluation and checkpoints are "other". A step the non-finite guard skips has no optimizer phase.

With ``time_hooks``, time spent inside plugin event hooks (all plugins' ``on_*`` implementations,
the doctor's included) is measured around each event dispatch and carved out of the phase it fell
into, so the shares add up; without it that time stays in its phase and no ``hooks`` share is
logged.

Host clock only, no device sync: on CUDA, device work that the host does not wait for shows up
where the host next waits (usually at a sync: the non-finite check, the optimizer step or the
logging read), and "data" may overlap device compute, so the input-bound warning is an upper bound
there.
"""

from __future__ import annotations

import time

from .settings import PREFIX

PHASES = ("data", "forward", "backward", "optimizer", "hooks", "other")
#: The input-bound warning judges spans of at least this many optimizer steps...
MIN_SPAN_STEPS = 8
#: ... and this much wall time: a share over a few steps or milliseconds is one fetch's noise.
MIN_SPAN_SECONDS = 1.0


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
    """Accumulates per-phase seconds between event timestamps (hook time carved out when a
    ``HookTimer`` is given)."""

    def __init__(self, hooks: HookTimer | None = None) -> None:
        self.hooks = hooks
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.phase = "other"
        self._t = time.perf_counter()
        self._h = 0.0
        self._window_start = self._t

    def mark(self, next_phase: str) -> float:
        """The current phase ends now; ``next_phase`` starts. Returns the clock read."""
        t = time.perf_counter()
        if self.hooks is None:
            self.totals[self.phase] += t - self._t
        else:
            h = self.hooks.seconds
            in_hooks, self._h = h - self._h, h
            self.totals[self.phase] += max(0.0, (t - self._t) - in_hooks)
            self.totals["hooks"] += in_hooks
        self.phase, self._t = next_phase, t
        return t

    def window(self) -> tuple[dict[str, float], float]:
        """Seconds per phase in this window and its wall time; starts the next window."""
        now = self.mark(self.phase)
        wall = max(now - self._window_start, 1e-9)
        seconds, self.totals = self.totals, dict.fromkeys(PHASES, 0.0)
        self._window_start = now
        return seconds, wall


def timing_logs(seconds: dict[str, float], wall: float, with_hooks: bool) -> dict[str, float]:
    return {
        f"{PREFIX}time_share_{p}": round(s / wall, 4)
        for p, s in seconds.items()
        if with_hooks or p != "hooks"
    }


class InputBoundJudge:
    """Whether the run waits for its data: judged on spans of consecutive windows of at least
    ``MIN_SPAN_STEPS`` steps and ``MIN_SPAN_SECONDS``, never on the first window (start-up: the
    first batches, workers starting, warm-up), and at most one warning per run. A short window
    (the last one of a run, or each one with ``logging_steps = 1``) joins the next; what is left
    when the run ends is not judged: a share over a step or two is that fetch's, not the run's."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.windows = 0
        self.warned = False
        self._data = self._wall = 0.0
        self._steps = 0

    def add(self, data_seconds: float, wall: float, steps: int) -> str | None:
        """The warning, when this window completes a span that waited too long for data."""
        self.windows += 1
        if self.windows == 1 or self.warned:
            return None
        self._data, self._wall, self._steps = (
            self._data + data_seconds,
            self._wall + wall,
            self._steps + steps,
        )
        if self._steps < MIN_SPAN_STEPS or self._wall < MIN_SPAN_SECONDS:
            return None
        share, steps = self._data / self._wall, self._steps
        self._data = self._wall = 0.0
        self._steps = 0
        if share <= self.threshold:
            return None
        self.warned = True
        return input_bound_warning(share, steps)


def input_bound_warning(share: float, steps: int) -> str:
    return (
        f"doctor: {100 * share:.0f}% of the wall time of the last {steps} steps was spent waiting "
        "for data (the run is input-bound): raise train.dataloader_num_workers, pre-tokenize, or "
        "pack sequences."
    )


class RunSplit:
    """The time split of the whole run (the first window, start-up, left out when there are
    others), for the one line the doctor prints at the end."""

    def __init__(self) -> None:
        self.first: dict[str, float] | None = None
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.wall = 0.0
        self.steps = 0

    def add(self, seconds: dict[str, float], wall: float, steps: int) -> None:
        if self.first is None:
            self.first = {**seconds, "_wall": wall, "_steps": steps}
            return
        for p, s in seconds.items():
            self.seconds[p] += s
        self.wall += wall
        self.steps += steps

    def shares(self) -> tuple[dict[str, float], int] | None:
        if self.wall > 0:
            return {p: s / self.wall for p, s in self.seconds.items()}, self.steps
        if self.first is not None:
            wall = max(self.first["_wall"], 1e-9)
            return {p: self.first[p] / wall for p in PHASES}, int(self.first["_steps"])
        return None


def split_line(shares: dict[str, float], with_hooks: bool) -> str:
    return ", ".join(f"{p} {100 * s:.0f}%" for p, s in shares.items() if with_hooks or p != "hooks")
