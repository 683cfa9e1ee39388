"""A progress bar for evaluation and prediction on a terminal (``corelooper eval`` / ``predict``,
and ``corelooper run``'s evaluations outside training).

The console's bar (``corelooper.builtin.console``) counts optimizer steps while ``train()`` runs;
an evaluation alone showed nothing for as long as it took. This per-run object counts the
evaluation's batches (``on_prediction_step``) in a bar of its own, on rank 0, when stdout is a
terminal and ``train.disable_tqdm`` is off, and removes it when the evaluation ends. While the
training bar is live (an evaluation between steps) it stays out of the way: one live display at a
time, and training's bar already says where the run is.
"""

from __future__ import annotations

import math
import sys


class EvalProgress:
    name = "cli.progress"  # its plugin name

    def __init__(self, dataset=None) -> None:
        self.dataset = dataset  # the data evaluated (None: the loop's eval_dataset)
        self.progress = None
        self.task = None
        self.off = False  # decided at an evaluation's first batch: no bar for this one

    def _batches(self, loop) -> int | None:
        """This rank's batches: each rank takes a contiguous block of the data set."""
        dataset = self.dataset if self.dataset is not None else loop.eval_dataset
        try:
            per_rank = math.ceil(len(dataset) / loop.backend.num_processes)
        except TypeError:  # a stream: no length
            return None
        return math.ceil(per_rank / loop.args.per_device_eval_batch_size)

    def on_prediction_step(self, loop, state) -> None:
        if self.task is None and not self.off:
            console = loop.plugins.get("console")
            self.off = (
                not state.is_world_process_zero
                or console is None  # -p no:console: quiet
                or getattr(console, "progress", None) is not None  # training's bar is live
                or loop.args.disable_tqdm
                or not sys.stdout.isatty()
            )
            if self.off:
                return
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("[bold]eval"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                transient=True,
            )
            self.task = self.progress.add_task("eval", total=self._batches(loop))
            self.progress.start()
        if self.task is not None:
            self.progress.advance(self.task)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.progress = self.task = None
        self.off = False

    on_evaluate = on_predict = on_exception = stop  # an evaluation's end, whichever way it ends
