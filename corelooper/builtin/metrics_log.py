"""``output_dir/metrics.jsonl``: one JSON object per ``on_log`` (training logs and evaluation
metrics: ``"event"`` is ``"log"`` or ``"eval"``), each with "step".

Registered as the plugin ``jsonl``, one ``MetricsLog`` per run; written by the main process
only. The file stays open between logs (each record is flushed: a kill loses no written line),
so a run logging every step does not pay an open and a close per step.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import IO

from ..hookspecs import hookimpl


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf
    return v


def _event(logs: dict) -> str:
    """Evaluation metrics reach on_log too (as in HF); they are the ones with a split prefix
    (the test HF's loggers use to file them under eval/ and test/)."""
    return "eval" if any(k.startswith(("eval_", "test_")) for k in logs) else "log"


def _step_of(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except ValueError:  # a line cut by a kill: drop it
        return math.inf


class MetricsLog:
    def __init__(self) -> None:
        self.file: IO[str] | None = None
        self.output_dir: str | None = None  # the file's folder (train.output_dir)

    @hookimpl
    def on_log(self, loop, state, logs) -> None:
        if not state.is_world_process_zero:
            return
        record = {"event": _event(logs), "step": state.global_step, **{k: _clean(v) for k, v in logs.items()}}
        output_dir = loop.args.output_dir
        try:
            if self.file is None or self.output_dir != output_dir:
                self.close()
                Path(output_dir).mkdir(parents=True, exist_ok=True)
                self.file = open(os.path.join(output_dir, "metrics.jsonl"), "a")
                self.output_dir = output_dir
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:  # disk full, read-only: an I/O error, not the plugin's or the model's
            from ..checkpoints.ioerrors import io_error
            from ..checkpoints.run_dir import intact_note

            self.close()
            raise io_error(
                e, "writing metrics.jsonl", Path(output_dir), intact_note(Path(output_dir))
            ) from None

    @hookimpl
    def on_load_checkpoint(self, loop, state) -> None:
        """Resuming: drop the records a cut-short run wrote after its checkpoint, so the file
        reads as one run (those steps are trained, and logged, again)."""
        path = Path(loop.args.output_dir) / "metrics.jsonl"
        if not state.is_world_process_zero or not path.is_file():
            return
        self.close()
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _step_of(line) <= state.global_step]
        if len(kept) != len(lines):
            tmp = path.with_name(".metrics.jsonl.tmp")
            tmp.write_text("".join(kept))
            tmp.replace(path)

    @hookimpl
    def on_train_end(self) -> None:
        self.close()

    @hookimpl
    def on_exception(self) -> None:
        self.close()

    def close(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            except OSError:  # its last flush failed: that error was raised where it happened
                pass
            self.file = self.output_dir = None
