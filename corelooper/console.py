"""Console output: a rich progress bar on a terminal, plain log lines otherwise.

Registered as the plugin ``console``; ``-p no:console`` silences it.
"""

from __future__ import annotations

import sys

from .hookspecs import hookimpl

_progress = None
_task = None


def _format(logs: dict) -> str:
    parts = []
    for k, v in logs.items():
        if isinstance(v, float):
            v = f"{v:.4g}" if abs(v) < 1e5 else f"{v:.0f}"
        parts.append(f"{k}={v}")
    return " ".join(parts)


def _print(text: str) -> None:
    if _progress is not None:
        _progress.console.print(text, highlight=False, markup=False)
    else:
        print(text, flush=True)


@hookimpl
def on_train_begin(loop, state):
    global _progress, _task
    if not state.is_world_process_zero:
        return
    _print(
        f"corelooper: training {state.max_steps} steps ({state.num_train_epochs} epochs x "
        f"{state.steps_per_epoch} steps), batch {state.train_batch_size} x "
        f"{state.gradient_accumulation_steps} accumulation x {state.world_size} processes, "
        f"output in {loop.args.output_dir}"
    )
    if loop.args.disable_tqdm or not sys.stdout.isatty():
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    _progress = Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"), transient=False,
    )
    _task = _progress.add_task("train", total=state.max_steps, completed=state.global_step, info="")
    _progress.start()


@hookimpl
def on_step_end(state):
    if _progress is not None:
        _progress.update(_task, completed=state.global_step)


@hookimpl
def on_log(state, logs):
    if _progress is not None and "loss" in logs:
        _progress.update(_task, info=f"loss {logs['loss']:.4g}")
    _print(f"[step {state.global_step}/{state.max_steps}] {_format(logs)}")


@hookimpl
def on_save(state, checkpoint_dir):
    if state.is_world_process_zero:  # every rank takes part in a save; one reports it
        _print(f"saved {checkpoint_dir}")


def _stop() -> None:
    global _progress
    if _progress is not None:
        _progress.stop()
        _progress = None


@hookimpl
def on_train_end():
    _stop()


@hookimpl
def on_exception():
    _stop()
