"""``Doctor``: the per-run object. Healthy steps cost a few clock reads and attribute writes per
event; everything that syncs or allocates runs only when something went wrong (or once, after
the first step, for the memory breakdown)."""

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


class Doctor:
    name = "doctor.run"

    def __init__(self, config) -> None:
        self.cfg = config.section(SECTION)
        if self.cfg["on_spike"] not in ON_SPIKE:
            raise ConfigError(
                f"doctor.on_spike = {self.cfg['on_spike']!r}: use one of {list(ON_SPIKE)} "
                "(\"skip_batch\" drops the spiking step's update and skips it again on resume)."
            )
        from .spikes import SpikeDetector

        self.spikes = SpikeDetector(self.cfg["spike_factor"], self.cfg["spike_window"])
        self.per_step = self.cfg["spike_per_step"] or self.cfg["on_spike"] == "skip_batch"
        self.skipped_steps: dict[int, Any] = {}  # restored from a checkpoint
        self.nonfinite_reports = 0
        self.watchdog = self.clock = self.hook_timer = self.probe = None
        self.breakdown: dict | None = None
        self.steps_done = 0
        self.windows_logged, self.warned_input = 0, False
        self.window_steps: deque = deque(maxlen=256)  # (step, position in epoch, micro-batches)

    # -- checkpoint state ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"spikes": self.spikes.state_dict(), "nonfinite_reports": self.nonfinite_reports,
                "skipped_steps": {str(k): v for k, v in self.skipped_steps.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.spikes.load_state_dict(state.get("spikes", {}))
        self.nonfinite_reports = state.get("nonfinite_reports", 0)
        self.skipped_steps = {int(k): v for k, v in state.get("skipped_steps", {}).items()}

    # -- start and end -------------------------------------------------------------------------------
    def on_train_begin(self, loop, state) -> None:
        from .spikes import SkippedBatches

        self.rank, self.world = loop.backend.process_index, state.world_size
        self.device, self.out = loop.backend.device, loop.args.output_dir
        self.skipped = SkippedBatches(self.out)
        self.skipped.steps.update(self.skipped_steps)
        if state.global_step > 0:  # resuming: also the steps skipped after that checkpoint
            self.skipped.load()
        self.skipped_steps = self.skipped.steps  # one record: checkpoints save what the file has
        self._start_timing(loop)
        self._start_memory()
        self._start_watchdog()
        self.peak = None
        if not loop.args.peak_flops:
            from .peaks import device_peak_flops

            self.peak, _ = device_peak_flops()

    def _start_timing(self, loop) -> None:
        if not self.cfg["timing"]:
            return
        from .timing import HookTimer, PhaseClock

        self.hook_timer = HookTimer()
        if self.cfg["time_hooks"]:
            self.hook_timer.install(loop.plugins)
        self.clock = PhaseClock(self.hook_timer)
        self.clock.phase = "data"

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

        self.watchdog = Watchdog(self.out, self.rank, self.world, self.cfg["hang_timeout"],
                                 self.cfg["hang_step_factor"], default_store())
        self.watchdog.start()

    def _stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.hook_timer is not None:
            self.hook_timer.uninstall()
        if self.probe is not None:
            self.probe.stop()
            self.probe = None

    def on_train_end(self) -> None:
        self._stop()

    # -- the step (hot path: no syncs) ------------------------------------------------------------
    def _beat(self, state, event: str) -> None:
        if self.watchdog is not None:
            self.watchdog.progress(state.global_step, event)

    def _mark(self, phase: str) -> None:
        if self.clock is not None:
            self.clock.mark(phase)

    def on_epoch_begin(self, state) -> None:
        self._mark("data")
        self._beat(state, "on_epoch_begin")

    def on_step_begin(self, loop, state) -> None:
        self._mark("forward")
        self._beat(state, "on_step_begin")
        self._step_t0 = time.perf_counter()
        self._micro, self._step_loss = 0, None
        if self.watchdog is not None:
            self.watchdog.long_phase = self.steps_done == 0
        self.window_steps.append((state.global_step + 1, state.micro_batches_in_epoch, loop.num_micro_batches))
        if self.steps_done == 0 and self.cfg["memory"]:
            from .memory import ActivationProbe

            self.probe = ActivationProbe()
            self.probe.start(loop.backend.unwrap_model(loop.model))

    def on_before_backward(self, state, loss) -> None:
        self._mark("backward")
        self._beat(state, "on_before_backward")
        if self.probe is not None and self.breakdown is None:
            self.probe.stop()  # one forward measured; the probe object keeps its count
        if self.per_step:
            self._step_loss = loss.detach() if self._step_loss is None else self._step_loss + loss.detach()

    def on_after_backward(self, loop, state) -> None:
        self._micro += 1
        self._mark("optimizer" if self._micro >= loop.num_micro_batches else "forward")
        self._beat(state, "on_after_backward")

    def on_pre_optimizer_step(self, loop, state, optimizer) -> None:
        self._beat(state, "on_pre_optimizer_step")
        if self.per_step or self.skipped.steps:
            from .actions import per_step_spike

            per_step_spike(self, loop, state, optimizer)

    def on_step_end(self, loop, state, control) -> None:
        busy = control.should_log or control.should_evaluate or control.should_save
        self._mark("other" if busy else "data")
        self._beat(state, "on_step_end")
        self.steps_done += 1
        if self.watchdog is not None:
            self.watchdog.step_time(time.perf_counter() - self._step_t0)
            # Between steps (logging, evaluation, checkpoints, a preemption save, the next
            # batches) only hang_timeout applies: the median step time says nothing about them.
            self.watchdog.long_phase = True
        if self.steps_done == 1 and self.probe is not None:
            from .actions import first_step_breakdown

            first_step_breakdown(self, loop, state)

    # -- logging, evaluation, saving ------------------------------------------------------------------
    @hookimpl(tryfirst=True)
    def on_log(self, loop, state, control, logs) -> None:
        self._mark("other" if control.should_evaluate or control.should_save else "data")
        self._beat(state, "on_log")
        if "loss" not in logs:
            return  # the run summary
        from .actions import window_logs

        window_logs(self, loop, state, logs)

    def on_prediction_step(self, state) -> None:
        self._beat(state, "on_prediction_step")

    def on_evaluate(self, state, control) -> None:
        self._mark("other" if control.should_save else "data")
        self._beat(state, "on_evaluate")

    def on_save(self, state) -> None:
        self._mark("data")
        self._beat(state, "on_save")

    def on_epoch_end(self, state) -> None:
        self._mark("other")
        self._beat(state, "on_epoch_end")
        if self.watchdog is not None:
            self.watchdog.long_phase = True

    # -- when something went wrong -------------------------------------------------------------------
    def on_nonfinite(self, loop, state, micro_batches, sample_indices, loss, grad_norm, action) -> None:
        self._beat(state, "on_nonfinite")
        if not self.cfg["explain_nonfinite"] or self.nonfinite_reports >= self.cfg["max_nonfinite_reports"]:
            return
        self.nonfinite_reports += 1
        from .actions import explain_step

        explain_step(self, loop, state, micro_batches, sample_indices, loss, grad_norm, action)

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
