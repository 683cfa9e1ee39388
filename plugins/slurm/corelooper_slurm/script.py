"""The sbatch script of ``corelooper slurm``: one torchrun per node, requeue on a warning signal.

How a preemption or time limit plays out (``--signal=B:USR1@<grace>`` + ``--requeue``):

1. Slurm sends SIGUSR1 to the batch shell about ``grace`` seconds before the end (up to 60 s
   earlier: Slurm's event resolution), or ``scancel --signal=USR1 --batch JOB`` does, by hand;
   the shell's trap passes it to ``srun``, which forwards it to its tasks (one per node:
   ``python -m corelooper_slurm.node torchrun``, torchrun's agent in that process);
2. torchrun, started with ``--signals_to_handle ...,SIGUSR1``, forwards it to every rank, and
   waits up to ``--shutdown_timeout`` (the grace) for them;
3. every rank (``CORELOOPER_STOP_SIGNALS=SIGUSR1``) finishes its optimizer step; all agree on
   the step, save one checkpoint, and exit (128 + 10); each node prints one line with its
   ranks' exit status;
4. the shell requeues the job (``scontrol requeue``) only when this restart wrote a checkpoint
   newer than the one it resumed from, every node stopped cleanly and the job was requeued fewer
   than ``--max-requeues`` times; otherwise it says why and exits with corelooper's code (the
   README's table): 128 + the signal (138) at ``--max-requeues`` (saved, resumable), 75 when
   nothing was saved, the failed rank's 2-7. Requeued, the same command resumes
   (``--resume-from-checkpoint auto``: the newest checkpoint, else a fresh start). SIGTERM
   (``scancel``) saves the same way and ends the job with 143.

With ``--min-nodes`` below ``--nodes`` a lost node (or its task) does not end the job
(``--no-kill``, ``srun --kill-on-bad-exit=0 --no-kill``): torchrun's agents on the others
(``--nnodes MIN:MAX --max_restarts K``) re-rendezvous and their ranks resume the newest checkpoint;
the job has succeeded when at least MIN nodes finished (docs/clusters.md, Slurm).
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
    cpus_per_task: int | None = None  # default: the whole node (--exclusive) for the node's task
    job_name: str | None = None
    output: str | None = None
    signal: str = "USR1"
    grace: int = 120  # seconds between the warning signal and the end of the allocation
    port: int | None = None  # default: the first free from 15000 + job id % 10000, on the job's first node
    max_requeues: int = 20
    min_nodes: int | None = None  # default: nodes (a lost node ends the job); fewer: elastic
    max_restarts: int | None = None  # torchrun's restarts: default 3 when elastic, else 0
    output_dir: Path | None = None  # the config's train.output_dir (with --set), resolved
    overrides: list[str] = field(default_factory=list)
    plugin_options: list[str] = field(default_factory=list)
    sbatch_args: list[str] = field(default_factory=list)
    python: str = sys.executable
    workdir: Path = field(default_factory=Path.cwd)

    @property
    def procs(self) -> int:
        return self.nproc_per_node or max(self.gpus_per_node, 1)

    @property
    def min(self) -> int:
        return self.nodes if self.min_nodes is None else self.min_nodes

    @property
    def elastic(self) -> bool:
        """Fewer nodes than allocated may go on: a lost node's survivors re-rendezvous."""
        return self.min < self.nodes

    @property
    def restarts(self) -> int:
        if self.max_restarts is not None:
            return self.max_restarts
        return 3 if self.elastic else 0

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

    if (
        spec.nodes < 1
        or spec.gpus_per_node < 0
        or (spec.nproc_per_node is not None and spec.nproc_per_node < 1)
    ):
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
    if not 1 <= spec.min <= max(spec.nodes, 1):
        raise ConfigError(
            f"--min-nodes {spec.min} with --nodes {spec.nodes}: give 1 to {spec.nodes} (the fewest nodes the "
            "run may go on with after losing some), or leave it out (then a lost node ends the job)."
        )
    if spec.restarts < 0:
        raise ConfigError(
            f"--max-restarts {spec.restarts}: give 0 (a lost node or failed rank ends the run) "
            "or more (torchrun restarts the ranks that many times, from the newest checkpoint)."
        )
    if spec.max_requeues < 0:
        raise ConfigError(f"--max-requeues {spec.max_requeues}: give 0 (never requeue) or more.")
    if spec.port is not None and not 1024 <= spec.port <= 65535:
        raise ConfigError(
            f"--port {spec.port}: give a free TCP port from 1024 to 65535, or leave it out "
            "(then each job uses the first free port from 15000 + its job id % 10000)."
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
        f"--cpus-per-task={spec.cpus_per_task}" if spec.cpus_per_task else "--exclusive",
        *([f"--time={spec.time}"] if spec.time else []),
        *([f"--partition={spec.partition}"] if spec.partition else []),
        *([f"--account={spec.account}"] if spec.account else []),
        f"--output={spec.output or 'slurm-%x-%j.out'}",
        "--open-mode=append",  # a requeued job appends to the same log
        "--requeue",
        # a node that fails does not end the allocation: the survivors go on (see the srun line)
        *(["--no-kill"] if spec.elastic else []),
        f"--signal=B:{sig}@{spec.grace}",  # to the batch shell, which passes it on (see the trap)
        f"--chdir={spec.workdir}",
        *spec.sbatch_args,
    ]
    run = ["-m", "corelooper", "run", str(spec.config), "--resume-from-checkpoint", "auto"]
    for item in spec.overrides:
        run += ["--set", item]
    for item in spec.plugin_options:
        run += ["-p", item]
    torchrun = [  # torch.distributed.run's arguments (corelooper_slurm.node runs it)
        "--nnodes",
        f'"{spec.min}:$SLURM_NNODES"' if spec.elastic else '"$SLURM_NNODES"',
        "--nproc_per_node",
        str(spec.procs),
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        '"$head_node:$port"',
        "--rdzv_id",
        '"$SLURM_JOB_ID"',
        "--max_restarts",
        str(spec.restarts),
        "--signals_to_handle",
        f"{TORCHRUN_SIGNALS},SIG{sig}",
        "--shutdown_timeout",
        str(spec.grace),
    ]
    quoted = [a if a.startswith('"') else shlex.quote(a) for a in torchrun]
    output_dir = spec.output_dir or spec.workdir / "output"
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        _HEADER.format(
            sig=sig,
            python=spec.python,
            workdir=spec.workdir,
            config=spec.config,
            output_dir=output_dir,
            max_requeues=spec.max_requeues,
        ),
        _BODY.format(
            sig=sig,
            python=shlex.quote(spec.python),
            output_dir=shlex.quote(str(output_dir)),
            state_dir=shlex.quote(str(output_dir.parent / f".{output_dir.name}.slurm")),
            # below Linux's ephemeral ports (32768 up), which any connection may hold for a while
            port=spec.port
            if spec.port is not None
            else '$("$python" -m corelooper_slurm.node port $(( 15000 + SLURM_JOB_ID % 10000 )))',
            srun_cpus=f"--cpus-per-task={spec.cpus_per_task} "
            if spec.cpus_per_task
            else '--cpus-per-task="$SLURM_CPUS_ON_NODE" ',
            max_requeues=spec.max_requeues,
            resumable=128 + int(getattr(signal, f"SIG{sig}")),
            min_nodes=spec.min if spec.elastic else '"$SLURM_NNODES"',
            elastic=_ELASTIC if spec.elastic else "",
            srun_kill="--kill-on-bad-exit=0 --no-kill" if spec.elastic else "--kill-on-bad-exit=1",
            torchrun=" \\\n    ".join(_pairs(quoted)),
            run=" ".join(shlex.quote(a) for a in run),
        ),
    ]
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


_HEADER = """\
# Written by `corelooper slurm`. On SIG{sig} (sent before the time limit or a preemption): every
# rank finishes its step and saves a checkpoint; the job requeues itself when that checkpoint is
# newer than the one this restart resumed from (at most {max_requeues} times) and resumes from it.
# Baked in when the script was written (every node must see them at these paths):
#   python:     {python}
#   workdir:    {workdir}
#   config:     {config}
#   output_dir: {output_dir}"""

# Only with --min-nodes below --nodes.
_ELASTIC = """
# A node that comes back in a later rendezvous round waits for an address torch's shared store
# never writes (seen with torch 2.13): see docs/clusters.md, "A node lost mid-job".
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"""

_BODY = """\
set -uo pipefail
export CORELOOPER_STOP_SIGNALS=SIG{sig}{elastic}
python={python}
output_dir={output_dir}
state_dir={state_dir}/job-$SLURM_JOB_ID
node_names=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))  # by SLURM_NODEID
head_node=${{node_names[0]}}
export CORELOOPER_SLURM_HEAD_NODE="$head_node"  # it hosts the rendezvous store
min_nodes={min_nodes}
port={port}
restarts=${{SLURM_RESTART_COUNT:-0}}
say() {{ echo "corelooper-slurm: $*" >&2; }}
resumed=$("$python" -m corelooper_slurm.node latest "$output_dir")
if [ "$resumed" -gt 0 ]; then from="resumed from checkpoint-$resumed"; else from="starting fresh (no checkpoint yet)"; fi
say "job $SLURM_JOB_ID (restart $restarts) on $SLURM_JOB_NODELIST: $from; rendezvous $head_node:$port"
rm -rf "$state_dir"
signalled=""
on_signal() {{
  signalled={sig}
  say "SIG{sig}: every rank finishes its step and saves a checkpoint"
}}
on_cancel() {{  # scancel, a preemption without the warning: Slurm signals every node's task itself
  signalled=TERM
  say "SIGTERM (scancel or a preemption): every rank finishes its step and saves a checkpoint"
}}
trap on_signal {sig}
trap on_cancel TERM
srun {srun_kill} {srun_cpus}\\
    "$python" -m corelooper_slurm.node torchrun "$state_dir" -- \\
    {torchrun} \\
    {run} &
srun_pid=$!
while true; do
  wait "$srun_pid"
  status=$?
  kill -0 "$srun_pid" 2>/dev/null || break  # wait returned for the trap: the step still runs
  [ "$signalled" = {sig} ] || continue  # SIGTERM reaches the nodes from Slurm (and srun) already
  # pass it on once every node's task (with --min-nodes: that many) holds it (a task still
  # starting Python would die of it);
  # srun forwards it to each node's torchrun
  while [ "$(ls "$state_dir" 2>/dev/null | grep -c '^ready-')" -lt "$min_nodes" ] && kill -0 "$srun_pid" 2>/dev/null; do
    sleep 0.5
  done
  kill -{sig} "$srun_pid" 2>/dev/null
done
newest=$("$python" -m corelooper_slurm.node latest "$output_dir")
states=$(cut -d' ' -f1 "$state_dir"/node-* 2>/dev/null | sort -u | tr '\n' ' ')
failed=$(grep -h '^failed ' "$state_dir"/node-* 2>/dev/null | head -n 1 | cut -d' ' -f2)
nodes=$(ls "$state_dir" 2>/dev/null | grep -c '^node-')
for id in "${{!node_names[@]}}"; do
  [ -e "$state_dir/node-$id" ] || say "node ${{node_names[$id]}}: lost; its task ended without a status (killed, or the node failed)"
done
rm -rf "$state_dir"
# The job's exit code is corelooper's (README, exit codes): sacct and scontrol show it.
if [ "$states" = "finished " ] && [ "$nodes" -ge "$min_nodes" ]; then
  say "finished on $nodes of $SLURM_NNODES nodes (newest checkpoint-$newest)"
  exit 0
fi
if [ -n "$failed" ] || [ "$nodes" -lt "$min_nodes" ]; then
  say "not requeueing: a node failed or was lost (node states: ${{states:-none }}from $nodes of $SLURM_NNODES nodes, at least $min_nodes needed; srun exit $status); exit ${{failed:-7}}"
  exit "${{failed:-7}}"
fi
if [ "$newest" -le "$resumed" ] && [ "$signalled" = TERM ]; then
  say "cancelled before this restart saved a step (newest checkpoint-$resumed); exit 75"
  exit 75
fi
if [ "$newest" -le "$resumed" ]; then
  say "not requeueing: this restart wrote no checkpoint newer than checkpoint-$resumed (the signal came before a step was saved); exit 75"
  exit 75
fi
if [ "$signalled" != {sig} ]; then
  say "cancelled: checkpoint-$newest saved; resume with the same command (a new job resumes it); exit 143"
  exit 143
fi
if [ "$restarts" -ge {max_requeues} ]; then
  say "not requeueing: --max-requeues {max_requeues} reached (restart $restarts); checkpoint-$newest saved: resume with the same command; exit {resumable}"
  exit {resumable}
fi
say "requeueing job $SLURM_JOB_ID: checkpoint-$newest is newer than checkpoint-$resumed (requeue $(( restarts + 1 )) of at most {max_requeues})"
scontrol requeue "$SLURM_JOB_ID"
exit 0
"""
