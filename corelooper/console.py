"""Console output: a rich progress bar on a terminal, plain log lines otherwise.

One ``Console`` per run, registered as the builtin plugin ``console``; ``-p no:console``
silences it. Only the main process prints.
"""

from __future__ import annotations

import sys


def _format(logs: dict) -> str:
    parts = []
    for k, v in logs.items():
        if isinstance(v, float):
            v = f"{v:.4g}" if abs(v) < 1e5 else f"{v:.0f}"
        parts.append(f"{k}={v}")
    return " ".join(parts)


class Console:
    def __init__(self) -> None:
        self.progress = None
        self.task = None

    def print(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text, highlight=False, markup=False)
        else:
            print(text, flush=True)

    def on_train_begin(self, loop, state) -> None:
        if not state.is_world_process_zero:
            return
        self.print(
            f"corelooper: training {state.max_steps} steps ({state.num_train_epochs} epochs x "
            f"{state.steps_per_epoch} steps), batch {state.train_batch_size} x "
            f"{state.gradient_accumulation_steps} accumulation x {state.world_size} processes, "
            f"output in {loop.args.output_dir}"
        )
        if loop.args.disable_tqdm or not sys.stdout.isatty():
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"), transient=False,
        )
        self.task = self.progress.add_task("train", total=state.max_steps, completed=state.global_step, info="")
        self.progress.start()

    def on_step_end(self, state) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=state.global_step)

    def on_log(self, state, logs) -> None:
        if not state.is_world_process_zero:
            return
        if self.progress is not None and "loss" in logs:
            self.progress.update(self.task, info=f"loss {logs['loss']:.4g}")
        self.print(f"[step {state.global_step}/{state.max_steps}] {_format(logs)}")

    def on_evaluate(self, state, metrics) -> None:
        if state.is_world_process_zero:
            self.print(f"[step {state.global_step}/{state.max_steps}] {_format(metrics)}")

    def on_save(self, state, checkpoint_dir) -> None:
        if state.is_world_process_zero:  # every rank takes part in a save; one reports it
            self.print(f"saved {checkpoint_dir}")

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def on_train_end(self) -> None:
        self.stop()

    def on_exception(self) -> None:
        self.stop()
