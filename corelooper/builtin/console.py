"""Console output: a rich progress bar on a terminal, plain log lines otherwise.

One ``Console`` per run, registered as the builtin plugin ``console``; ``-p no:console``
silences it. Only the main process prints.

A log key with a namespace, ``name/key`` (e.g. a diagnosis plugin's ``diag/time_share_data``),
or one of ``DETAILS`` (model FLOPs per token, TFLOP/s) is a detail: loggers, ``metrics.jsonl``
and ``log_history`` get it, the console line leaves it out unless the run is verbose
(``corelooper run --verbose``, or ``CORELOOPER_VERBOSE=1`` for a ``Loop`` in a script), so a
line shows the training essentials.
"""

from __future__ import annotations

import os
import sys

# Facts a user does not act on at every log: metrics.jsonl and the loggers have them, the console
# line only when verbose. The line keeps loss, grad norm, learning rate, epoch and samples/tokens per second.
DETAILS = frozenset({"model_flops_per_token", "model_tflops_per_second"})


def is_detail(key: str) -> bool:
    """A namespaced log key (``name/key``) or a detail: not on the console unless verbose."""
    return "/" in key or key in DETAILS


def _format(logs: dict, verbose: bool = True) -> str:
    parts = []
    for k, v in logs.items():
        if not verbose and is_detail(k):
            continue
        if isinstance(v, float):
            v = f"{v:.4g}" if abs(v) < 1e3 else f"{v:.0f}"  # 19130, not 1.913e+04
        parts.append(f"{k}={v}")
    return " ".join(parts)


class Console:
    def __init__(self) -> None:
        self.progress = None
        self.task = None
        self.verbose = False
        self.resumed_from = None  # the checkpoint folder on_load_checkpoint named

    def print(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text, highlight=False, markup=False)
        else:
            print(text, flush=True)

    def on_train_begin(self, loop, state) -> None:
        self.verbose = bool(os.environ.get("CORELOOPER_VERBOSE"))  # `corelooper run --verbose` sets it
        if not state.is_world_process_zero:
            return
        per_epoch = state.steps_per_epoch  # 0: data of unknown length, max_steps says when to stop
        epochs = (
            f"{state.max_steps / per_epoch:.3g} epochs of {per_epoch} steps" if per_epoch else "max_steps"
        )
        self.print(
            f"corelooper: training {state.max_steps} steps ({epochs}), batch {state.train_batch_size} x "
            f"{state.gradient_accumulation_steps} accumulation x {state.world_size} processes, "
            f"output in {loop.args.output_dir}"
        )
        if self.resumed_from is not None:
            self.print(
                f"corelooper: resuming from {self.resumed_from.name} (step {state.global_step} of "
                f"{state.max_steps})"
            )
        if loop.args.disable_tqdm or not sys.stdout.isatty():
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            transient=False,
        )
        self.task = self.progress.add_task(
            "train", total=state.max_steps, completed=state.global_step, info=""
        )
        self.progress.start()

    def on_load_checkpoint(self, checkpoint_dir) -> None:
        self.resumed_from = checkpoint_dir

    def on_step_end(self, state) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=state.global_step)

    def on_log(self, state, logs) -> None:
        if not state.is_world_process_zero:
            return
        if self.progress is not None and "loss" in logs:
            self.progress.update(self.task, info=f"loss {logs['loss']:.4g}")
        self.print(f"[step {state.global_step}/{state.max_steps}] {_format(logs, self.verbose)}")

    def on_save(self, state, checkpoint_dir) -> None:
        if state.is_world_process_zero:  # every rank takes part in a save; one reports it
            self.print(f"saved {checkpoint_dir}")

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    on_train_end = on_exception = stop  # the bar ends with training, whichever way it ends


def quiet_library(modules: str, loggers: tuple[str, ...] = ()) -> None:
    """For a plugin's library, as the CLI does for torch's and accelerate's: its deprecation notices
    (``modules``, a regex of module names) and its loggers below ERROR are hidden, in a CLI run
    without ``--verbose`` (``CORELOOPER_QUIET`` set by the CLI; a ``Loop`` in a script shows all)."""
    import logging
    import warnings

    if not os.environ.get("CORELOOPER_QUIET"):
        return
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=rf"({modules})(\.|$)")
    for name in loggers:
        logging.getLogger(name).addFilter(lambda record: record.levelno >= logging.ERROR)
