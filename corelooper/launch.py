"""``corelooper run CONFIG --nproc N``: start N local processes through torch's own launcher.

The launcher runs ``torch.distributed.run`` (torchrun) in this process with a standalone
rendezvous; each child re-runs the same ``corelooper run`` command without ``--nproc`` and
reads RANK / WORLD_SIZE / MASTER_ADDR from the environment, exactly as under ``torchrun``.
When a rank fails, torchrun stops the others; the first failure is reported by rank, with the
message that rank wrote to its torchelastic error file (``record_child_error``).
"""

from __future__ import annotations

import json
import os
import sys
import time

from .errors import CorelooperError


class LaunchError(CorelooperError):
    """A rank of a multi-process run failed (its own error is printed above by that rank)."""

    exit_code = 7


def child_argv(config: str, overrides: list[str] | None, plugin_options: list[str] | None,
               resume: str | None, traceback: bool) -> list[str]:
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
    return argv


def launch(nproc: int, argv: list[str]) -> None:
    """Run ``python -m corelooper *argv`` in ``nproc`` local processes; raise on failure."""
    if nproc < 1:
        from .errors import ConfigError

        raise ConfigError(f"--nproc must be at least 1, got {nproc}.")
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    args = get_args_parser().parse_args(
        [f"--nproc_per_node={nproc}", "--max_restarts=0", "--monitor_interval=0.2",
         "-m", "corelooper", *argv]
    )
    # What torchrun --standalone does: a local c10d rendezvous on a free port (no fixed
    # MASTER_PORT, so several runs on one machine do not collide).
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    args.master_port = 29500  # unused by the c10d rendezvous; torchrun sets the same default
    config, cmd, cmd_args = config_from_args(args)
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except ChildFailedError as e:
        raise LaunchError(describe_failure(e, nproc)) from None


def describe_failure(error, nproc: int) -> str:
    rank, failure = error.get_first_failure()
    if failure.exitcode < 0:
        how = f"was killed by signal {failure.signal_name()}"
    else:
        how = f"exited with code {failure.exitcode}"
    message = failure.message if isinstance(failure.message, str) else json.dumps(failure.message)
    if message.startswith("To enable traceback"):
        message = "see its output above"
    others = [r for r in error.failures if r != rank]
    also = f" (ranks {others} failed too)" if others else ""
    return (
        f"rank {rank} of {nproc} (local rank {failure.local_rank}, pid {failure.pid}) {how}{also}: "
        f"{message.rstrip('.')}. The other ranks were stopped."
    )


def record_child_error(exc: BaseException) -> None:
    """Write ``exc`` to this rank's torchelastic error file, so the launcher can name it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": f"{type(exc).__name__}: {exc}", "timestamp": int(time.time())}, f)
    except OSError:  # reporting must never hide the error itself
        print(f"corelooper: could not write {path}", file=sys.stderr)
