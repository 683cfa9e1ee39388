"""``output_dir/metrics.jsonl``: one JSON object per ``on_log`` (training logs and evaluation
metrics: ``"event"`` is ``"log"`` or ``"eval"``), each with "step".

Registered as the plugin ``jsonl``; written by the main process only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .hookspecs import hookimpl


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf
    return v


def _write(loop, state, event: str, values: dict) -> None:
    if not state.is_world_process_zero:
        return
    record = {"event": event, "step": state.global_step, **{k: _clean(v) for k, v in values.items()}}
    path = Path(loop.args.output_dir) / "metrics.jsonl"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:  # disk full, read-only: an I/O error, not the plugin's or the model's
        from .ioerrors import io_error
        from .output_dir import intact_note

        raise io_error(e, "writing metrics.jsonl", path.parent, intact_note(path.parent)) from None


def _event(logs: dict) -> str:
    """Evaluation metrics reach on_log too (as in HF); they are the ones with a split prefix
    (the test HF's loggers use to file them under eval/ and test/)."""
    return "eval" if any(k.startswith(("eval_", "test_")) for k in logs) else "log"


@hookimpl
def on_log(loop, state, logs):
    _write(loop, state, _event(logs), logs)


@hookimpl
def on_load_checkpoint(loop, state):
    """Resuming: drop the records a cut-short run wrote after its checkpoint, so the file reads
    as one run (those steps are trained, and logged, again)."""
    path = Path(loop.args.output_dir) / "metrics.jsonl"
    if not state.is_world_process_zero or not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _step_of(line) <= state.global_step]
    if len(kept) != len(lines):
        tmp = path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)


def _step_of(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except ValueError:  # a line cut by a kill: drop it
        return math.inf
