"""The command line's public API: what a plugin's command may use (docs/plugins.md).

A plugin adds commands through ``corelooper_add_commands``; to behave as ``corelooper run``
does, it takes the same options (``SetOpt``, ``PluginOpt``, ``TracebackOpt``), loads the config
the same way (``split_plugin_options``, ``load_config``) and reports an error the same way
(``fail``: one paragraph and the exit code). A rank that decides to exit names its error to the
``--nproc`` launcher with ``record_child_error``; a plugin that runs torchrun itself reads which
rank failed and its code with ``root_failure`` and ``exit_code_of`` and keeps torchrun's log lines
off the console with ``quiet_launcher_logs``; ``read_metrics`` reads a run's ``metrics.jsonl``;
``write_records`` writes per-sample records as ``corelooper predict`` does (JSON Lines).
Everything else under ``corelooper.cli`` is internal (``tests/test_layers.py``
checks that plugins import nothing else from it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from corelooper.errors import DataError

__all__ = [
    "SetOpt",
    "PluginOpt",
    "TracebackOpt",
    "split_plugin_options",
    "load_config",
    "fail",
    "record_child_error",
    "root_failure",
    "exit_code_of",
    "quiet_launcher_logs",
    "read_metrics",
    "write_records",
]

# exit codes of errors in the user's input (config, data, checkpoint or I/O): the message names the
# key, file, line or errno; a traceback of corelooper's own code would not help, so none is offered
INPUT_ERRORS = (2, 4, 5)

#: The key of a rank's torchelastic error file that holds the code it exits with: a rank can still
#: die of SIGABRT after writing it ("terminate called without an active exception" at exit).
REPORTED_CODE = "corelooper_exit_code"

SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        metavar="KEY=VALUE",
        help="Override a config value: --set train.learning_rate=3e-4 (repeatable).",
    ),
]
PluginOpt = Annotated[
    list[str] | None,
    typer.Option(
        "-p",
        metavar="NAME",
        help="-p no:NAME disables an installed plugin; -p pkg.module registers a local one.",
    ),
]
TracebackOpt = Annotated[bool, typer.Option("--traceback", help="Show the full traceback of an error.")]


def split_plugin_options(options: list[str] | None) -> tuple[list[str], list[str]]:
    """``-p no:NAME`` -> blocked names; ``-p module`` -> local plugin modules."""
    blocked, local = [], []
    for opt in options or []:
        if opt.startswith("no:"):
            blocked.append(opt[3:])
        else:
            local.append(opt)
    return blocked, local


def load_config(config: Path, overrides: list[str] | None, local_plugins: list[str]):
    """The config ``corelooper run`` trains: ``config`` (a TOML file) with the ``--set``
    ``overrides`` applied and the ``-p`` modules added to ``[plugins] local``."""
    from corelooper.config import Config

    cfg = Config.load(config, overrides or [])
    cfg = cfg.replace("plugins", local=[*cfg.plugins.local, *local_plugins])
    return cfg


def fail(exc: BaseException, show_traceback: bool) -> None:
    """Print a one-paragraph error (or the traceback when asked) and exit non-zero.

    A worker of ``--nproc`` hands its error to the launcher (which prints it once, naming the
    rank) instead of printing it; under another launcher a rank names itself."""
    from corelooper.cli.signals import pending_stop

    from corelooper.errors import CorelooperError

    stop = pending_stop()  # a library swallowed a stop signal's exception, then failed otherwise
    if stop is not None:
        say_stopped(stop)
    code = exc.exit_code if isinstance(exc, CorelooperError) else 1
    if getattr(exc, "exit_code", None) in (130, 143):  # launcher: the ranks stopped on a signal
        raise typer.Exit(exc.exit_code)
    if show_traceback or os.environ.get("CORELOOPER_TRACEBACK"):
        import traceback

        traceback.print_exception(exc)
    recorded = False
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # a rank under torchrun: name it to the launcher
        from corelooper.cli.launch import under_launcher

        recorded = record_child_error(exc, code) and under_launcher()
    if not recorded:
        prefix = "error" if isinstance(exc, CorelooperError) else f"unexpected error ({type(exc).__name__})"
        world = os.environ.get("WORLD_SIZE", "1")
        rank = f" (rank {os.environ.get('RANK', '0')} of {world})" if world != "1" else ""
        typer.echo(f"corelooper: {prefix}{rank}: {exc}", err=True)
        if not show_traceback and code not in INPUT_ERRORS:
            typer.echo("(run with --traceback for the full traceback)", err=True)
    exit_if_distributed(code)
    raise typer.Exit(code)


def say_stopped(stop) -> None:
    """A stop signal outside training (``StartupStop``): one line (rank 0), exit 75 / 76."""
    if os.environ.get("RANK", "0") == "0":
        typer.echo(f"corelooper: {stop}. Exit {stop.exit_code}.", err=True)
    raise typer.Exit(stop.exit_code) from None


def exit_if_distributed(code: int = 0) -> None:
    """A rank of a multi-process command that is done (finished, or its error reported): run the
    exit handlers, then skip the interpreter's teardown. Threads left by the process group (a
    failed rank cannot take it down: the others may be inside a collective) or by rank 0's
    rendezvous store can abort a teardown ("terminate called without an active exception"), and
    the launcher would then report a signal instead of this exit code."""
    if os.environ.get("WORLD_SIZE", "1") != "1":
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def record_child_error(exc: BaseException, exit_code: int) -> bool:
    """Write ``exc`` and the code this rank exits with to its torchelastic error file, so the
    launcher can name it. Returns whether it was written."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return False
    try:
        with open(path, "w") as f:
            json.dump(
                {
                    "message": f"{type(exc).__name__}: {exc}",
                    "timestamp": int(time.time()),
                    REPORTED_CODE: exit_code,
                },
                f,
            )
    except OSError:  # reporting must never hide the error itself
        print(f"corelooper: could not write {path}", file=sys.stderr)
        return False
    return True


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of a run's ``metrics.jsonl`` (``run_dir``: its output_dir or the file), one
    dict per line; a last line cut by a run still writing is left out, any other bad line is a
    ``DataError`` naming the file and line."""
    path = Path(run_dir) / "metrics.jsonl" if Path(run_dir).is_dir() else Path(run_dir)
    if not path.is_file():
        raise DataError(
            f"{str(run_dir)!r} has no metrics.jsonl: pass the output_dir of a run (the jsonl plugin "
            "writes output_dir/metrics.jsonl while training), or the metrics.jsonl file itself."
        )
    records = []
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            if n == len(lines):
                continue  # a run still writing: its last line may be cut
            raise DataError(f"{str(path)!r} line {n} is not JSON: {line[:80]!r}") from None
    return records


def reported_code(failure) -> int | None:
    """The code a rank meant to exit with, as its error file records it (``record_child_error``)."""
    data = getattr(failure, "error_file_data", None)
    code = data.get(REPORTED_CODE) if isinstance(data, dict) else None
    return code if isinstance(code, int) else None


def exit_code_of(failure) -> int:
    """The rank's exit code; for a rank that reported its error and then died of a signal while
    shutting down (a C++ thread's abort at exit), the code it reported."""
    reported = reported_code(failure)
    return reported if failure.exitcode < 0 and reported is not None else failure.exitcode


def failure_message(failure) -> str:
    return failure.message if isinstance(failure.message, str) else json.dumps(failure.message)


def root_failure(error):
    """``(rank, failure)`` that caused the others. torchrun's first failure is the earliest by
    timestamp (whole seconds): a rank whose collective failed because another rank raised
    (``PeerLostError``) can be first within the same second, so a rank that raised its own error
    comes before the others (collective failures, deaths by signal); the earliest among equals."""

    def key(item):
        message = failure_message(item[1])
        raised = (
            exit_code_of(item[1]) > 0
            and not message.startswith("To enable traceback")
            and "PeerLostError" not in message
        )
        return not raised, item[1].timestamp

    return min(error.failures.items(), key=key)


def quiet_launcher_logs() -> None:
    """No torchrun log line on the console ("Received 15 death signal", "Sending process ...
    closing signal", "failed (exitcode: -9)"): corelooper says what happened in one paragraph.

    Called once torch's launcher modules are imported. Their loggers are named after each
    module, and a parent logger's filter does not see a child's records: every existing logger
    under the launcher's names gets the filter, and so do the handlers that print them (torch's
    own on ``torch``, the root's)."""
    import logging

    from corelooper.cli.quiet import LAUNCHER_LOGGERS

    def keep(record: logging.LogRecord) -> bool:
        return not record.name.startswith(LAUNCHER_LOGGERS)

    for name in list(logging.root.manager.loggerDict):
        if name.startswith(LAUNCHER_LOGGERS):
            logging.getLogger(name).addFilter(keep)
    for logger in (logging.getLogger(), logging.getLogger("torch")):
        for handler in logger.handlers:
            handler.addFilter(keep)
    logging.lastResort.addFilter(keep)


def write_records(path: str | Path, records) -> int:
    """One JSON line per record, written to a temporary file and renamed into place (what
    ``corelooper predict`` does with ``predict_records``' answer); returns how many."""
    from corelooper.cli.predictions import write_records as write

    return write(path, records)
