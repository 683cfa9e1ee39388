"""The CLI's quiet start: third-party deprecation noise and launcher banners filtered, one rank speaks.

``corelooper run --verbose`` shows all. Plugins hide their own library's notices with
``corelooper.builtin.console.quiet_library``, which follows what this set.
"""

from __future__ import annotations

# Third-party chatter that does not concern the user's run: deprecation notices raised inside
# torch.distributed / accelerate / transformers for their own calls (plugins add their
# libraries with quiet_library), and the launchers' banners. `corelooper run --verbose` shows all.
_QUIET_MODULES = r"(torch|accelerate|transformers|torchelastic)(\.|$)"
# the launcher's own logs (a failed rank is reported by corelooper, naming it): nothing passes
LAUNCHER_LOGGERS = ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")
# the libraries' logs: errors pass
_LIBRARY_LOGGERS = ("accelerate",)


def one_voice() -> None:
    """On a rank other than 0: corelooper's and its plugins' notes (``corelooper*`` loggers,
    below ERROR) are not printed; rank 0 prints each once. Filters on the handlers that print
    (a parent logger's filter does not see its children's records)."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not record.name.startswith("corelooper")

    for handler in (*logging.getLogger().handlers, logging.lastResort):
        if handler is not None:
            handler.addFilter(keep)


def quiet_third_party(verbose: bool = False) -> None:
    """Filter third-party deprecation warnings and banners (inherited by launched workers)."""
    import logging
    import os
    import warnings

    if os.environ.get("RANK", "0") != "0":
        one_voice()
    if verbose:
        os.environ["CORELOOPER_VERBOSE"] = "1"
        return
    if os.environ.get("CORELOOPER_VERBOSE"):
        return
    os.environ["CORELOOPER_QUIET"] = "1"  # quiet_library applies (plugins' libraries), workers too
    # transformers' "Writing model shards" bar at every checkpoint (read when it is imported)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=_QUIET_MODULES)
    # torch.distributed's own deprecation notices, attributed to the calling library's line
    warnings.filterwarnings(
        "ignore",
        message=r".*(reduce_scatter_tensor|all_gather_into_tensor|"
        r"_reduce_scatter_base|_all_gather_base).*",
    )
    # (workers run this too: their CLI gets --verbose passed on.) Filters, not levels: DeepSpeed
    # resets its logger's level when it is imported.
    for name in LAUNCHER_LOGGERS:
        logging.getLogger(name).addFilter(lambda record: False)
    for name in _LIBRARY_LOGGERS:
        logging.getLogger(name).addFilter(lambda record: record.levelno >= logging.ERROR)
    if os.environ.get("RANK", "0") != "0":
        # One voice: the ranks run the same code, so rank 0 shows every warning once.
        warnings.simplefilter("ignore")


class ClosedPipeQuiet:
    """``sys.stdout`` / ``sys.stderr`` that go quiet when their reader closes the pipe
    (``corelooper run ... | head``): the run goes on and ends as it would have, rather than a
    plugin that printed a line being blamed for the ``BrokenPipeError`` (exit 3). The file
    descriptor is pointed at ``/dev/null``, so the interpreter's last flush succeeds too."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def quiet_on_closed_pipes() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` (once) in ``ClosedPipeQuiet``."""
    import sys

    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, ClosedPipeQuiet):
            setattr(sys, name, ClosedPipeQuiet(stream))
