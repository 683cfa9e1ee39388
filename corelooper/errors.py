"""Errors users see: one paragraph naming what is wrong and how to fix it."""

from __future__ import annotations


class CorelooperError(Exception):
    """Base of every error corelooper reports to users without a traceback."""

    exit_code = 2


class ConfigError(CorelooperError):
    """A config file, key or value is wrong."""


class PluginError(CorelooperError):
    """A plugin failed to load, or raised inside one of its hooks."""

    exit_code = 3


class DataError(CorelooperError):
    """A dataset, sample or collator produced something the loop cannot use."""

    exit_code = 4


class CheckpointError(CorelooperError):
    """A checkpoint is missing, incomplete, or does not match the model."""

    exit_code = 5


class TrainingError(CorelooperError):
    """The model or the training step itself failed."""

    exit_code = 6


class PeerLostError(CorelooperError):
    """A collective failed: another process of the run stopped, or the network between them."""

    exit_code = 7


# What torch's process groups say when the other end of a collective is gone (gloo, NCCL, the store).
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "NCCL error",
    "ProcessGroupNCCL",
    "ProcessGroupGloo",
    "third_party/gloo",
    "Socket Timeout",
)


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed collective rather than a bug where it was raised."""
    import sys

    dist = sys.modules.get("torch.distributed")  # only a run with several processes imported it
    if dist is not None and isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _PEER_LOST)


def import_failure(exc: BaseException) -> str:
    """Why and where an import failed: ``SyntaxError: expected ':' (/x/plugin.py, line 2)``, the
    place being the innermost frame outside the import system."""
    import traceback

    if isinstance(exc, SyntaxError) and exc.filename:
        return f"SyntaxError: {exc.msg} ({exc.filename}, line {exc.lineno})"
    frames = [(f.f_code.co_filename, n) for f, n in traceback.walk_tb(exc.__traceback__)]
    where = [f"{name}, line {n}" for name, n in frames if not name.startswith("<")][-1:]
    return f"{type(exc).__name__}: {exc}{''.join(f' ({w})' for w in where)}"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def user_frame(exc: BaseException, user_code: dict) -> tuple[str, str] | None:
    """``(what, "file:line")`` of the innermost traceback frame running a callable the user gave
    (``{what: a function, or an object whose update/compute/... methods count}``)."""
    codes = {}
    for what, given in user_code.items():
        for f in (given, *(getattr(type(given), n, None) for n in ("__call__", "update", "compute", "sync"))):
            codes[getattr(getattr(f, "__func__", f), "__code__", None)] = what
    hit, tb = None, exc.__traceback__
    while tb is not None:
        if codes.get(tb.tb_frame.f_code) is not None:
            hit = (codes[tb.tb_frame.f_code], f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}")
        tb = tb.tb_next
    return hit


def explain_failure(
    exc: BaseException,
    plugins,
    global_step: int,
    output_dir,
    action: str = "Training",
    user_code: dict | None = None,
) -> BaseException:
    """An exception from training turned into one that names where it came from: the plugin and
    hook whose code raised (``plugins.blame``), a callable the user gave the Loop (``user_code``:
    ``{"compute_metrics": fn}``), else the model or its loss."""
    if isinstance(exc, CorelooperError) or not isinstance(exc, Exception):
        return exc
    if peer_lost(exc):  # whoever waited on the collective (a plugin, DDP's backward) is not to blame
        return PeerLostError(
            f"{action} stopped at global_step {global_step}: a collective between the processes failed "
            f"({type(exc).__name__}: {_first_line(exc)}). Another process of the run stopped (killed, "
            "crashed, or its node was lost) or the network between them failed: its own output names "
            f"the first failure. The last complete checkpoint in {str(output_dir)!r} is untouched; "
            "resume with --resume-from-checkpoint latest (on fewer processes if a node is gone)."
        )
    blamed = plugins.blame(exc)
    if blamed:
        plugin, hook = blamed
        info = plugins.info.get(plugin)
        # a per-run object ("NAME.run") is blocked through the plugin that registered it
        name = plugin.rsplit(".", 1)[0] if info is not None and info.kind == "run" else plugin
        return PluginError(
            f"Plugin {plugin!r} raised in hook {hook!r} at global_step {global_step}: "
            f"{type(exc).__name__}: {exc}. Fix the plugin, or disable it with `-p no:{name}`."
        )
    user = user_frame(exc, user_code or {})
    where = f"the run's {user[0]} ({user[1]}) raised " if user else ""
    blame = "Fix it there" if user else "The error came from the model or its loss"
    return TrainingError(
        f"{action} failed at global_step {global_step}: {where}{type(exc).__name__}: {exc}. {blame}; "
        f"the last complete checkpoint in {str(output_dir)!r} is untouched."
    )
