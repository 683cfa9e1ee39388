"""``corelooper run CONFIG --nproc N``: start N local processes through torch's own launcher.

The launcher runs ``torch.distributed.run`` (torchrun) in this process with a standalone
rendezvous; each child re-runs the same ``corelooper run`` command without ``--nproc`` and
reads RANK / WORLD_SIZE / MASTER_ADDR from the environment, exactly as under ``torchrun``.
When a rank fails, torchrun stops the others; the first failure is reported by rank, with the
message that rank wrote to its torchelastic error file (``record_child_error``), and the launcher
exits with that rank's code (2-6), or 7 when it died otherwise.

Stopping: SIGINT / SIGTERM to the launcher is forwarded to every rank by torchrun; a signal to
one rank reaches the others through the loop's per-step stop flag. Every rank finishes its step,
the checkpoint is written once, and the launcher exits 130 / 143 (its own signal, or the ranks'
code). ``kill -9`` of the launcher: each worker dies with it (``watch_launcher``), writing nothing
more.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from corelooper.cli.api import exit_code_of, failure_message, quiet_launcher_logs, root_failure

from corelooper.errors import CorelooperError


class LaunchError(CorelooperError):
    """A rank of a multi-process run failed (its own error is printed above by that rank)."""

    exit_code = 7


class Stopped(CorelooperError):
    """The run was stopped by SIGINT / SIGTERM after its ranks saved a checkpoint (130 / 143)."""

    def __init__(self, exit_code: int):
        super().__init__(f"stopped by {signal.Signals(exit_code - 128).name}")
        self.exit_code = exit_code


#: Set in every worker's environment by ``launch``: the launcher's pid, which it watches.
LAUNCHER_PID = "CORELOOPER_LAUNCHER_PID"
#: How long torchrun lets the ranks finish their step and save after a stop signal, before SIGKILL.
SHUTDOWN_TIMEOUT = 600
STOP_CODES = (128 + signal.SIGINT, 128 + signal.SIGTERM)


def child_argv(
    config: str,
    overrides: list[str] | None,
    plugin_options: list[str] | None,
    resume: str | None,
    traceback: bool,
    verbose: bool = False,
) -> list[str]:
    """The ``corelooper run`` arguments each child gets: the same command, without --nproc."""
    argv = ["run", str(config)]
    for item in overrides or []:
        argv += ["--set", item]
    for item in plugin_options or []:
        argv += ["-p", item]
    if resume:
        argv += ["--resume-from-checkpoint", resume]
    if traceback:
        argv.append("--traceback")
    if verbose:
        argv.append("--verbose")
    return argv


def launch(nproc: int, argv: list[str]) -> None:
    """Run ``python -m corelooper *argv`` in ``nproc`` local processes; raise on failure."""
    if nproc < 1:
        from corelooper.errors import ConfigError

        raise ConfigError(f"--nproc must be at least 1, got {nproc}.")
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    args = get_args_parser().parse_args(
        [f"--nproc_per_node={nproc}", "--max_restarts=0", "--monitor_interval=0.2", "-m", "corelooper", *argv]
    )
    # What torchrun --standalone does: a local c10d rendezvous on a free port (no fixed
    # MASTER_PORT, so several runs on one machine do not collide).
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    args.master_port = 29500  # unused by the c10d rendezvous; torchrun sets the same default
    if nproc > 1 and not os.environ.get("CORELOOPER_VERBOSE"):
        # torchrun sets OMP_NUM_THREADS=1 for each rank anyway, and prints a banner about it
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not os.environ.get("CORELOOPER_VERBOSE"):
        quiet_launcher_logs()
    config, cmd, cmd_args = config_from_args(args)
    config.shutdown_timeout = SHUTDOWN_TIMEOUT  # a stop signal: let every rank save first
    os.environ[LAUNCHER_PID] = str(os.getpid())  # inherited by the workers (watch_launcher)
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except SignalException as e:  # torchrun forwarded it to the ranks and waited for them
        raise Stopped(128 + int(e.sigval)) from None
    except ChildFailedError as e:
        raise launch_error(e, nproc) from None


def launch_error(error, nproc: int) -> CorelooperError:
    """What the launcher raises for torchrun's ``ChildFailedError``: ``Stopped`` (130 / 143) or a
    ``LaunchError`` naming the rank that caused it, with that rank's code when it was a reported
    corelooper error (2-6: bad config, data, checkpoint, plugin, ...), else 7."""
    code = stop_code(error)
    if code:
        return Stopped(code)
    failed = LaunchError(describe_failure(error, nproc))
    first = exit_code_of(root_failure(error)[1])
    if 2 <= first <= 6:
        failed.exit_code = first
    return failed


def stop_code(error) -> int:
    """130 / 143 when the ranks stopped on a signal (after saving); 0 for a real failure.

    Ranks that exited first make torchrun SIGTERM / SIGKILL the rest, which may die of that
    while tearing down: such deaths count as part of the stop."""
    codes = [f.exitcode for f in error.failures.values()]
    stopped = [c for c in codes if c in STOP_CODES]
    killed = (-signal.SIGTERM, -signal.SIGKILL, -signal.SIGINT)
    if not stopped or any(c not in STOP_CODES and c not in killed for c in codes):
        return 0
    return 128 + signal.SIGINT if 128 + signal.SIGINT in stopped else 128 + signal.SIGTERM


def describe_failure(error, nproc: int) -> str:
    rank, failure = root_failure(error)
    code = exit_code_of(failure)
    if code < 0:
        how = f"was killed by signal {failure.signal_name()}"
    elif failure.exitcode < 0:  # the error below is what failed; the signal came while shutting down
        how = f"failed with code {code} (then died of {failure.signal_name()} while shutting down)"
    else:
        how = f"exited with code {code}"
    message = failure_message(failure)
    if message.startswith("To enable traceback"):
        message = "see its output above"
    others = [r for r in error.failures if r != rank]
    also = f" (ranks {others} failed too)" if others else ""
    return (
        f"rank {rank} of {nproc} (local rank {failure.local_rank}, pid {failure.pid}) {how}{also}: "
        f"{message.rstrip('.')}. The other ranks were stopped."
    )


_launcher_pid: int | None = None


def under_launcher() -> bool:
    """A worker started by ``corelooper run --nproc``: the launcher reports for it."""
    return _launcher_pid is not None


def watch_launcher(interval: float = 0.5) -> None:
    """In a worker: die with the launcher. ``PR_SET_PDEATHSIG`` (Linux) makes the kernel
    SIGKILL this process when its parent dies; elsewhere (or if the parent had already gone)
    a thread watching the parent pid exits within ``interval`` seconds. Either way nothing is
    written after the launcher is gone (no checkpoint into an output_dir a new run may own).

    Applies to workers of ``--nproc`` and of plain torchrun (whose agent is the parent too)."""
    global _launcher_pid
    ours = os.environ.pop(LAUNCHER_PID, None)  # not inherited by processes this one starts
    if not ours and not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        _parent_death_signal(signal.SIGKILL)
    if ours:
        _launcher_pid = int(ours)
        if parent != _launcher_pid:
            os._exit(1)  # the launcher died before the signal was armed

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=watch, name="corelooper-watch-launcher", daemon=True).start()


def _parent_death_signal(sig: int) -> None:
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not glibc / musl: the watching thread still works
        pass
