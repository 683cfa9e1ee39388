"""The sbatch script of ``corelooper slurm``: one torchrun per node, requeue on a warning signal.

How a preemption or time limit plays out (``--signal=B:USR1@<grace>`` + ``--requeue``):

1. Slurm sends SIGUSR1 to the batch shell ``grace`` seconds before the end (or ``scancel
   --signal=USR1 --batch JOB`` does, by hand); the shell's trap notes it and passes it to
   ``srun``, which forwards it to its tasks (one ``torchrun`` per node);
2. torchrun, started with ``--signals_to_handle ...,SIGUSR1``, forwards it to every rank, and
   waits up to ``--shutdown_timeout`` (the grace) for them;
3. every rank (``CORELOOPER_STOP_SIGNALS=SIGUSR1``) finishes its optimizer step; all agree on
   the step, save one checkpoint, and exit;
4. the shell runs ``scontrol requeue $SLURM_JOB_ID``: the job goes back to the queue and, when it
   starts again, the same command resumes (``--resume-from-checkpoint auto``: the newest
   checkpoint if there is one, else a fresh start).
"""

from __future__ import annotations

import shlex
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


@dataclass
class JobSpec:
    config: Path
    nodes: int = 1
    gpus_per_node: int = 0
    nproc_per_node: int | None = None  # default: gpus_per_node, or 1 on CPU nodes
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    job_name: str | None = None
    output: str | None = None
    signal: str = "USR1"
    grace: int = 120  # seconds between the warning signal and the end of the allocation
    port: int = 29500
    overrides: list[str] = field(default_factory=list)
    plugin_options: list[str] = field(default_factory=list)
    sbatch_args: list[str] = field(default_factory=list)
    python: str = sys.executable
    workdir: Path = field(default_factory=Path.cwd)

    @property
    def procs(self) -> int:
        return self.nproc_per_node or max(self.gpus_per_node, 1)

    @property
    def signal_name(self) -> str:
        """``USR1`` from ``USR1``, ``SIGUSR1`` or ``10``."""
        name = self.signal.upper().removeprefix("SIG")
        if name.isdigit():
            name = signal.Signals(int(name)).name.removeprefix("SIG")
        return name


def check(spec: JobSpec) -> None:
    """Refuse what sbatch would refuse later, in words."""
    from corelooper.errors import ConfigError

    if spec.nodes < 1 or spec.gpus_per_node < 0 or (spec.nproc_per_node is not None and spec.nproc_per_node < 1):
        raise ConfigError(
            f"--nodes {spec.nodes} --gpus-per-node {spec.gpus_per_node}: use at least 1 node and 0 "
            "or more GPUs per node (and --nproc-per-node >= 1 when given)."
        )
    try:
        sig = getattr(signal, f"SIG{spec.signal_name}")
    except (AttributeError, ValueError):
        sig = None
    if sig is None or spec.signal_name in ("KILL", "STOP"):
        raise ConfigError(
            f"--signal {spec.signal!r} is not a signal a job can catch. Use USR1 (the default), USR2 "
            "or another catchable signal name."
        )
    if spec.grace < 1:
        raise ConfigError(f"--grace {spec.grace}: give the seconds the job needs to save (e.g. 120).")


def render(spec: JobSpec) -> str:
    """The sbatch script for ``spec`` (a bash script with #SBATCH lines)."""
    check(spec)
    sig = spec.signal_name
    name = spec.job_name or f"corelooper-{spec.config.stem}"
    directives = [
        f"--job-name={name}",
        f"--nodes={spec.nodes}",
        "--ntasks-per-node=1",  # one torchrun per node; it starts the node's ranks
        *([f"--gpus-per-node={spec.gpus_per_node}"] if spec.gpus_per_node else []),
        *([f"--cpus-per-task={spec.cpus_per_task}"] if spec.cpus_per_task else []),
        *([f"--time={spec.time}"] if spec.time else []),
        *([f"--partition={spec.partition}"] if spec.partition else []),
        *([f"--account={spec.account}"] if spec.account else []),
        f"--output={spec.output or 'slurm-%x-%j.out'}",
        "--open-mode=append",  # a requeued job appends to the same log
        "--requeue",
        f"--signal=B:{sig}@{spec.grace}",  # to the batch shell, which passes it on (see the trap)
        f"--chdir={spec.workdir}",
        *spec.sbatch_args,
    ]
    run = ["-m", "corelooper", "run", str(spec.config), "--resume-from-checkpoint", "auto"]
    for item in spec.overrides:
        run += ["--set", item]
    for item in spec.plugin_options:
        run += ["-p", item]
    torchrun = [
        spec.python, "-m", "torch.distributed.run", "--nnodes", '"$SLURM_NNODES"',
        "--nproc_per_node", str(spec.procs), "--rdzv_backend", "c10d",
        "--rdzv_endpoint", f'"$head_node:{spec.port}"', "--rdzv_id", '"$SLURM_JOB_ID"',
        "--max_restarts", "0", "--signals_to_handle", f"{TORCHRUN_SIGNALS},SIG{sig}",
        "--shutdown_timeout", str(spec.grace),
    ]
    quoted = [a if a.startswith('"') else shlex.quote(a) for a in torchrun]
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), _BODY.format(
        sig=sig,
        torchrun=" \\\n    ".join([" ".join(quoted[:3]), *_pairs(quoted[3:])]),
        run=" ".join(shlex.quote(a) for a in run),
    )]
    return "\n".join(lines)


def _pairs(args: list[str]) -> list[str]:
    """``--flag value`` per line, for a readable script."""
    out: list[str] = []
    for a in args:
        if a.startswith("--") or not out:
            out.append(a)
        else:
            out[-1] += f" {a}"
    return out


_BODY = """\
# Written by `corelooper slurm`. On SIG{sig} (sent before the time limit or a preemption): every
# rank finishes its step and saves a checkpoint, then this job requeues itself and resumes from it.
set -uo pipefail
export CORELOOPER_STOP_SIGNALS=SIG{sig}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
requeue=0
on_signal() {{
  requeue=1
  echo "corelooper-slurm: SIG{sig}: saving a checkpoint, then requeueing job $SLURM_JOB_ID" >&2
  kill -{sig} "$srun_pid" 2>/dev/null  # srun forwards it to every node's torchrun
}}
trap on_signal {sig}
echo "corelooper-slurm: job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}) on $SLURM_JOB_NODELIST" >&2
srun --kill-on-bad-exit=1 \\
    {torchrun} \\
    {run} &
srun_pid=$!
while true; do
  wait "$srun_pid"
  status=$?
  kill -0 "$srun_pid" 2>/dev/null || break  # wait returned for the trap: the step still runs
done
if [ "$requeue" = 1 ]; then
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
"""
