"""What the sbatch script runs on the nodes (``python -m corelooper_slurm.node ...``).

``latest OUTPUT_DIR``
    The step of the newest ``checkpoint-N`` folder in OUTPUT_DIR (0 when there is none): the
    batch shell compares it before and after a restart to tell whether the restart made progress.
    A ``checkpoint-N`` folder appears only by the rename that ends a complete save (a save cut
    short stays ``.tmp-checkpoint-N``), so listing names is enough and reads no weights.

``port FIRST``
    The first TCP port from FIRST (FIRST to FIRST + 99, in steps of 1) that nothing on this node
    holds, for the rendezvous store: the batch shell, which runs on the job's first node, asks
    before it starts the nodes. A port is free when a socket binds to it without SO_REUSEADDR,
    so one that another program listens on, or uses as the local end of a connection, is
    skipped. FIRST when none is free (the node's line then names the port that failed).

``torchrun STATE_DIR -- TORCHRUN_ARGS...``
    One per node (the ``srun`` task): torchrun's elastic agent run in this process, so that a
    warning signal, a finished run and a failed rank each end in one line per node with every
    rank's exit status — instead of torchrun's ``SignalException`` traceback and srun's "exited
    with code 1" — and in ``STATE_DIR/node-$SLURM_NODEID`` (``finished``, ``stopped`` or
    ``failed CODE``: CODE is corelooper's exit code for the rank that failed, 2-6 for a reported
    error, else 7) for the batch shell, which ends the job with it. ``interrupted`` is a stop signal
    that came before the ranks could save (start-up: they exit 75 / 76). Every line a rank
    prints reaches the job log as ``[NODE rank R]: ...`` (torchrun ``--tee 3`` with a line
    prefix). ``STATE_DIR/ready-$SLURM_NODEID`` says the process holds the warning signal (the batch
    shell passes it on only then). Exits 0 when every rank finished or stopped on a signal (so
    srun reports no error), else CODE.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
#: What a rank exits with when a stop signal comes before training (``corelooper.cli.signals``).
STARTUP_STOPS = {75, 76}


def latest_step(output_dir: Path) -> int:
    if not output_dir.is_dir():
        return 0
    steps = [int(m.group(1)) for p in output_dir.iterdir() if (m := _CKPT_RE.match(p.name)) and p.is_dir()]
    return max(steps, default=0)


def free_port(first: int, tries: int = 100) -> int:
    for port in range(first, min(first + tries, 65536)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
            return port
    return first


def _stop_signals() -> set[int]:
    """The signals the ranks save and stop on: SIGTERM and SIGINT (always: ``scancel``, a
    preemption) and the script's CORELOOPER_STOP_SIGNALS (the warning signal)."""
    out = {int(signal.SIGTERM), int(signal.SIGINT)}
    for name in os.environ.get("CORELOOPER_STOP_SIGNALS", "").split(","):
        sig = getattr(signal, name.strip().upper(), None) if name.strip() else None
        if isinstance(sig, signal.Signals):
            out.add(int(sig))
    return out


def describe(code: int | None) -> str:
    """``0``, ``138 (stopped on SIGUSR1, saved)``, ``-9 (killed by SIGKILL)``."""
    if code is None:
        return "still running"
    if code < 0:
        return f"{code} (killed by {_name(-code)})"
    if code > 128 and code - 128 in _stop_signals():
        return f"{code} (stopped on {_name(code - 128)}, saved)"
    if code in STARTUP_STOPS:
        return f"{code} (stopped at start-up, nothing saved)"
    return str(code)


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def verdict(codes: dict[int, int | None]) -> str:
    """``finished`` (every rank 0), ``stopped`` (every rank saved and stopped on a stop signal,
    or finished), ``interrupted`` (a stop signal before the ranks could save: start-up, 75 / 76,
    or one that killed a rank before its handler was in place) or ``failed``."""
    stops = {128 + s for s in _stop_signals()}
    if codes and all(c == 0 for c in codes.values()):
        return "finished"
    if codes and all(c == 0 or c in stops for c in codes.values()):
        return "stopped"
    unsaved = stops | STARTUP_STOPS | {-s for s in _stop_signals()} | {0}
    if codes and all(c in unsaved for c in codes.values()):
        return "interrupted"
    return "failed"


def failure_code(error=None) -> int:
    """corelooper's exit code for a node that failed: the code of the rank that caused it (2-6, a
    reported error: config, plugin, data, checkpoint, training), else 7 (a rank died otherwise,
    or the rendezvous failed) -- what ``corelooper run --nproc`` exits with."""
    if error is None:
        return 7
    from corelooper.cli.api import exit_code_of, root_failure

    code = exit_code_of(root_failure(error)[1])
    return code if 2 <= code <= 6 else 7


def _record_shutdown_codes(codes: dict[int, int | None]) -> None:
    """After torchrun's agent stops its ranks (on a signal), note each rank's exit status.
    torchrun keeps them only inside the agent, so its shutdown is wrapped here; should a torch
    release rename what is read, the ranks' statuses are reported as unknown (never a crash)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = LocalElasticAgent._shutdown

    def _shutdown(self, *args, **kwargs):
        original(self, *args, **kwargs)
        try:
            ranks = {w.local_rank: w.global_rank for w in self.get_worker_group().workers}
            handlers = self._pcontext.subprocess_handlers
        except AttributeError:
            return
        codes.clear()  # a restart stops the group before: the node's line gives the last group's
        for local_rank, handler in handlers.items():
            codes[ranks.get(local_rank, local_rank)] = handler.proc.returncode

    LocalElasticAgent._shutdown = _shutdown


def _hold_early_signals() -> None:
    """A stop signal that arrives before torchrun has installed its handlers (while Python and
    torch import, or during the rendezvous) would kill this process unheard, or be lost. Hold it,
    and deliver it again as soon as torchrun's handler is in place (torchrun then stops the ranks
    as for any warning signal). Nothing is raised from the handler: code in between (imports,
    the rendezvous) could swallow an exception."""
    import threading

    held: list[int] = []

    def hold(signum, frame) -> None:
        held.append(signum)

    def redeliver() -> None:
        while True:
            for sig in set(held):
                if signal.getsignal(sig) is not hold:
                    held[:] = [s for s in held if s != sig]
                    os.kill(os.getpid(), sig)
            time.sleep(0.05)

    for sig in _stop_signals():
        signal.signal(sig, hold)
    threading.Thread(target=redeliver, name="corelooper-slurm-signals", daemon=True).start()


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as e:
        print(f"corelooper-slurm: cannot write {path}: {e.strerror}", file=sys.stderr)


def _run_torchrun(argv: list[str]) -> tuple[str, dict[int, int | None], str, int]:
    """Run torchrun in this process; returns (verdict, {rank: exit status}, what happened, the
    node's exit code)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import parse_args, run

    if not os.environ.get("CORELOOPER_VERBOSE"):  # as `corelooper run --nproc`: the node's line says it
        from corelooper.cli.api import quiet_launcher_logs

        quiet_launcher_logs()
    codes: dict[int, int | None] = {}
    _record_shutdown_codes(codes)
    try:
        run(parse_args(argv))
        return "finished", codes, "every rank finished", 0
    except SignalException as e:
        got = f"torchrun got {_name(int(e.sigval))}"
        state = verdict(codes) if codes else "interrupted"
        return state, codes, got, failure_code() if state == "failed" else 0
    except ChildFailedError as e:
        for rank, failure in e.failures.items():
            codes[rank] = failure.exitcode
        state = verdict(codes)
        if state != "failed":
            return state, codes, "a rank exited", 0
        code = failure_code(e)
        from corelooper.cli.api import root_failure

        return state, codes, f"rank {root_failure(e)[0]} failed (exit {code})", code
    except RendezvousError as e:
        return "failed", codes, rendezvous_failure(_endpoint(argv), e), 7
    except Exception as e:  # torchrun's own failure: still one line and a state for the batch shell
        first = (str(e).strip().splitlines() or [""])[0]
        return "failed", codes, f"torchrun failed: {type(e).__name__}: {first}", 7


def _endpoint(argv: list[str]) -> str:
    return next((v for k, v in zip(argv, argv[1:], strict=False) if k == "--rdzv_endpoint"), "?")


def rendezvous_failure(endpoint: str, error: BaseException) -> str:
    """What went wrong at the rendezvous, in one clause (torch's own message is a traceback)."""
    cause = error.__cause__ or error
    text = str(cause)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        port = endpoint.rpartition(":")[2]
        return (
            f"the rendezvous port {port} on {endpoint.rpartition(':')[0]} is held by another program "
            f"(EADDRINUSE): give `corelooper slurm --port` a free one, or leave it out to have one picked"
        )
    first = text.strip().splitlines()[0] if text.strip() else type(cause).__name__
    return f"the rendezvous at {endpoint} failed: {first}"


def _rendezvous_host(args: list[str]) -> list[str]:
    """The job's first node hosts the rendezvous store, the others connect to it. torchrun would
    guess from the hostname, and where several Slurm nodes share a host (a test cluster) every one
    would try; whichever won would take the store with it if it died."""
    head, here = os.environ.get("CORELOOPER_SLURM_HEAD_NODE"), os.environ.get("SLURMD_NODENAME")
    if not head or not here:
        return args
    # an explicit --rdzv_conf replaces torchrun's PET_RDZV_CONF: the user's settings from it
    # (last_call_timeout, keep_alive_interval, ...) are kept, is_host is the job's
    user = [
        kv for kv in os.environ.get("PET_RDZV_CONF", "").split(",") if kv and not kv.startswith("is_host=")
    ]
    return ["--rdzv_conf", ",".join([*user, f"is_host={int(head == here)}"]), *args]


def _labelled(args: list[str], log_dir: Path) -> list[str]:
    """Every line a rank prints goes to the job log as ``[NODE rank R]: ...``: torchrun copies the
    ranks' output (``--tee 3``: stdout and stderr, through files in ``log_dir``, which the batch
    shell removes with the rest of STATE_DIR) with a prefix naming this node and the rank. The
    ranks write unbuffered, so the lines keep their order within a rank."""
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    os.environ["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = f"[{node} rank ${{rank}}]: "
    os.environ["PYTHONUNBUFFERED"] = "1"
    return ["--tee", "3", "--log-dir", str(log_dir), *args]


def node_line(state: str, codes: dict[int, int | None], what: str) -> str:
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    cpus = os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get("SLURM_CPUS_ON_NODE") or "?"
    ranks = ", ".join(f"rank {r}: {describe(c)}" for r, c in sorted(codes.items())) or "no rank exit status"
    return f"corelooper-slurm: node {node} ({cpus} CPUs): {state}; {what}; {ranks}"


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "latest":
        print(latest_step(Path(argv[1])))
        return 0
    if len(argv) == 2 and argv[0] == "port" and argv[1].isdigit():
        print(free_port(int(argv[1])))
        return 0
    if len(argv) >= 3 and argv[0] == "torchrun" and argv[2] == "--":
        node = os.environ.get("SLURM_NODEID") or socket.gethostname()
        _hold_early_signals()
        _write(Path(argv[1]) / f"ready-{node}", "")  # the batch shell may now pass the signal on
        state, codes, what, code = _run_torchrun(
            _labelled(_rendezvous_host(argv[3:]), Path(argv[1]) / f"logs-{node}")
        )
        print(node_line(state, codes, what), file=sys.stderr, flush=True)
        _write(Path(argv[1]) / f"node-{node}", f"{state} {code}\n" if code else f"{state}\n")
        return code
    print(
        "usage: python -m corelooper_slurm.node latest OUTPUT_DIR | port FIRST | torchrun STATE_DIR -- ARGS...",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
