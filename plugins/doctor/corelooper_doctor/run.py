"""``Doctor``: the per-run object, and the small per-step hook objects only some settings need.

Per optimizer step the doctor costs, in its default settings, four event hooks with one clock
read and a few attribute writes each: ``on_step_begin`` and ``on_step_end`` (``Doctor``: the
watchdog's progress, the step time, the phase marks) and ``on_before_backward`` and
``on_pre_optimizer_step`` (``PhaseMarks``, with ``timing``); ``on_substep_end`` adds one per
extra micro-batch under gradient accumulation. ``StepLosses`` (``on_before_backward``,
``on_pre_optimizer_step``) is registered only for per-step spike checks, ``FirstForward`` only
for the first step's forward. Nothing on a healthy step reads a device value: everything that
syncs runs once per log (where the loop reads the loss anyway), once after the first step (the
memory breakdown), or when something went wrong. The one exception is asked for:
``on_spike = "skip_batch"`` reads each step's loss before ``optimizer.step()``.
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from corelooper.errors import ConfigError
from corelooper.hookspecs import hookimpl

from .settings import ON_SPIKE, SECTION

#: spike_per_step: step losses kept on the device at most this long before they are read.
MAX_PENDING_LOSSES = 256


class Doctor:
    name = "doctor.run"

    def __init__(self, config) -> None:
        self.cfg = config.section(SECTION)
        if self.cfg["on_spike"] not in ON_SPIKE:
            raise ConfigError(
                f"doctor.on_spike = {self.cfg['on_spike']!r}: use one of {list(ON_SPIKE)} "
                '("skip_batch" drops the spiking step\'s update and skips it again on resume).'
            )
        from .spikes import SpikeDetector

        self.spikes = SpikeDetector(self.cfg["spike_factor"], self.cfg["spike_window"])
        self.skip_batch = self.cfg["on_spike"] == "skip_batch"
        self.per_step = self.cfg["spike_per_step"] or self.skip_batch
        self.skipped_steps: dict[int, Any] = {}  # restored from a checkpoint
        self.nonfinite_reports = 0
        self.watchdog = self.clock = self.hook_timer = self.probe = self.syncs = None
        self.input_bound = self.run_split = None
        self.breakdown: dict | None = None
        self.memory_peak_gb: float | None = None
        self.steps_done = self.last_logged_step = self.logged_steps = 0  # logged_steps: in this run's windows
        self._step_t0 = 0.0
        self._step_loss = None
        self.step_losses: list = []  # (step, device loss) of spike_per_step, read at log steps
        self.spiked_in_window = False
        self.window_steps: deque = deque(maxlen=256)  # (step, position in epoch, micro-batches)

    def hook_objects(self) -> dict[str, Any]:
        """The per-step hook objects this config needs, by registration name."""
        out: dict[str, Any] = {}
        if self.cfg["timing"]:
            out["doctor.phases"] = PhaseMarks(self)
        if self.per_step:
            out["doctor.step_losses"] = StepLosses(self)
        if self.cfg["memory"]:
            out["doctor.first_forward"] = FirstForward(self)
        return out

    # -- checkpoint state ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "spikes": self.spikes.state_dict(),
            "nonfinite_reports": self.nonfinite_reports,
            "skipped_steps": {str(k): v for k, v in self.skipped_steps.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.spikes.load_state_dict(state.get("spikes", {}))
        self.nonfinite_reports = state.get("nonfinite_reports", 0)
        self.skipped_steps = {int(k): v for k, v in state.get("skipped_steps", {}).items()}

    # -- start and end -------------------------------------------------------------------------------
    def on_train_begin(self, loop, state) -> None:
        from .spikes import SkippedBatches

        self.rank, self.world = loop.backend.process_index, state.world_size
        self.device, self.out = loop.backend.device, loop.args.output_dir
        self.last_logged_step = state.global_step
        self.skipped = SkippedBatches(self.out)
        self.skipped.steps.update(self.skipped_steps)
        if state.global_step > 0:  # resuming: also the steps skipped after that checkpoint
            self.skipped.load()
        self.skipped_steps = self.skipped.steps  # one record: checkpoints save what the file has
        if self.skipped.steps and loop.plugins.get("doctor.step_losses") is None:
            loop.plugins.register(StepLosses(self), "doctor.step_losses")  # skip them again
        self._start_timing(loop)
        self._start_memory()
        self._start_watchdog()
        if self.cfg["count_syncs"]:
            from .syncs import start_counting

            self.syncs = start_counting(self.device)
        self.peak = None
        if not loop.args.peak_flops:
            from .peaks import device_peak_flops

            self.peak, _ = device_peak_flops()

    def _start_timing(self, loop) -> None:
        if not self.cfg["timing"]:
            return
        from .timing import HookTimer, InputBoundJudge, PhaseClock, RunSplit

        if self.cfg["time_hooks"]:
            self.hook_timer = HookTimer()
            self.hook_timer.install(loop.plugins)
        self.clock = PhaseClock(self.hook_timer)
        self.clock.phase = "data"
        self.input_bound = InputBoundJudge(self.cfg["input_bound_share"])
        self.run_split = RunSplit()

    def _start_memory(self) -> None:
        if not self.cfg["memory"]:
            return
        import torch

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            if self.cfg["memory_history"]:
                torch.cuda.memory._record_memory_history(max_entries=100_000)

    def _start_watchdog(self) -> None:
        if self.cfg["hang_timeout"] <= 0:
            return
        from .hang import Watchdog, default_store

        self.watchdog = Watchdog(
            self.out,
            self.rank,
            self.world,
            self.cfg["hang_timeout"],
            self.cfg["hang_step_factor"],
            default_store(),
        )
        self.watchdog.start()

    def _stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.hook_timer is not None:
            self.hook_timer.uninstall()
        if self.probe is not None:
            self.probe.stop()
            self.probe = None
        if self.syncs is not None:
            from .syncs import stop_counting

            stop_counting(self.syncs)
            self.syncs = None

    def on_train_end(self, state) -> None:
        if state.is_world_process_zero:
            from .actions import run_summary_line

            line = run_summary_line(self)
            if line:
                self.say(line)
        self._stop()

    # -- the step (hot path: one clock read per hook, no syncs) -----------------------------------------
    def _mark(self, phase: str) -> float:
        return self.clock.mark(phase) if self.clock is not None else time.perf_counter()

    def _beat(self, state, event: str, t: float | None = None) -> None:
        if self.watchdog is not None:
            self.watchdog.progress(state.global_step, event, t)

    def on_epoch_begin(self, state) -> None:
        self._beat(state, "on_epoch_begin", self._mark("data"))

    def on_step_begin(self, loop, state) -> None:
        self._step_t0 = t = self._mark("forward")
        self._step_loss = None
        if self.watchdog is not None:
            self.watchdog.progress(state.global_step, "on_step_begin", t)
            self.watchdog.long_phase = self.steps_done == 0
        self.window_steps.append(
            (state.global_step + 1, state.micro_batches_in_epoch, loop.num_micro_batches)
        )
        if self.steps_done == 0 and self.cfg["memory"]:
            from .memory import ActivationProbe

            self.probe = ActivationProbe()
            self.probe.start(loop.backend.unwrap_model(loop.model))

    def on_step_end(self, loop, state, control) -> None:
        busy = control.should_log or control.should_evaluate or control.should_save
        t = self._mark("other" if busy else "data")
        self.steps_done += 1
        if self.watchdog is not None:
            self.watchdog.progress(state.global_step, "on_step_end", t)
            self.watchdog.step_time(t - self._step_t0)
            # Between steps (logging, evaluation, checkpoints, a preemption save, the next
            # batches) only hang_timeout applies: the median step time says nothing about them.
            self.watchdog.long_phase = True
        if self._step_loss is not None:
            if not self.skip_batch:  # spike_per_step: read with the next log
                self.step_losses.append((state.global_step, self._step_loss))
            self._step_loss = None
        # every rank: the check's all-reduce, where the loop syncs anyway (a checkpoint keeps the
        # history; without logs, every MAX_PENDING_LOSSES steps)
        if control.should_log or control.should_save or len(self.step_losses) >= MAX_PENDING_LOSSES:
            self.check_step_losses(loop, state)
        if self.steps_done == 1 and self.probe is not None:
            from .actions import first_step_breakdown

            first_step_breakdown(self, loop, state)
            if loop.plugins.get("doctor.first_forward") is not None:
                loop.plugins.unregister("doctor.first_forward")

    def check_step_losses(self, loop, state) -> None:
        if self.step_losses:
            from .actions import check_step_losses

            check_step_losses(self, loop, state)

    # -- logging, evaluation, saving ------------------------------------------------------------------
    @hookimpl(tryfirst=True)
    def on_log(self, loop, state, control, logs) -> None:
        self._beat(
            state, "on_log", self._mark("other" if control.should_evaluate or control.should_save else "data")
        )
        if "loss" not in logs:
            return  # the run summary, or an evaluation
        from .actions import window_logs

        window_logs(self, loop, state, logs)

    def on_prediction_step(self, state) -> None:
        self._beat(state, "on_prediction_step")

    def on_evaluate(self, state, control) -> None:
        self._beat(state, "on_evaluate", self._mark("other" if control.should_save else "data"))

    def on_save(self, state) -> None:
        self._beat(state, "on_save", self._mark("data"))

    def on_epoch_end(self, loop, state) -> None:
        self._beat(state, "on_epoch_end", self._mark("other"))
        if self.watchdog is not None:
            self.watchdog.long_phase = True
        self.check_step_losses(loop, state)  # the last window, logged after the loop (every rank)

    # -- when something went wrong -------------------------------------------------------------------
    def on_nonfinite(self, loop, state, micro_batches, sample_indices, loss, grad_norm, action) -> None:
        self._beat(state, "on_nonfinite", self._mark("other"))  # the diagnosis is not the step's time
        if self.cfg["explain_nonfinite"] and self.nonfinite_reports < self.cfg["max_nonfinite_reports"]:
            self.nonfinite_reports += 1
            from .actions import explain_step

            explain_step(self, loop, state, micro_batches, sample_indices, loss, grad_norm, action)
        self._mark("optimizer")  # skip_step: what is left of the step is its zero_grad

    def on_exception(self, loop, state, exception) -> None:
        self._stop()
        from .memory import is_oom

        if self.cfg["memory"] and is_oom(exception):
            from .actions import oom_report

            oom_report(self, loop, state, exception)

    # -- helpers for actions ------------------------------------------------------------------------
    def write(self, relative: str, text: str) -> Path:
        path = Path(self.out) / "doctor" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def say(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def write_json(self, relative: str, data: Any) -> Path:
        return self.write(relative, json.dumps(data, indent=1, default=str) + "\n")


class PhaseMarks:
    """The time split's boundaries inside a step (``[doctor] timing``): one clock read each."""

    def __init__(self, doctor: Doctor) -> None:
        self.doc = doctor

    def on_before_backward(self) -> None:
        self.doc.clock.mark("backward")

    def on_substep_end(self) -> None:  # gradient accumulation: the next micro-batch's forward
        self.doc.clock.mark("forward")

    def on_pre_optimizer_step(self) -> None:
        self.doc.clock.mark("optimizer")


class StepLosses:
    """Each step's loss, summed on the device from the micro-batches' (``spike_per_step``:
    checked at the next log step, one all-reduce and one read per log; ``on_spike =
    "skip_batch"``: read before ``optimizer.step()``, one sync per step), and the skipping of
    recorded steps on resume."""

    def __init__(self, doctor: Doctor) -> None:
        self.doc = doctor

    def on_before_backward(self, loss) -> None:
        doc = self.doc
        if doc.per_step:
            doc._step_loss = loss.detach() if doc._step_loss is None else doc._step_loss + loss.detach()

    def on_pre_optimizer_step(self, loop, state, optimizer) -> None:
        from .actions import per_step_spike

        per_step_spike(self.doc, loop, state, optimizer)


class FirstForward:
    """Stops the activation probe after the first micro-batch's forward; unregistered after the
    first step."""

    def __init__(self, doctor: Doctor) -> None:
        self.doc = doctor

    def on_before_backward(self) -> None:
        if self.doc.probe is not None:
            self.doc.probe.stop()  # one forward measured; the probe object keeps its count
