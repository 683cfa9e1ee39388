"""A real Slurm on this machine: munged, slurmctld and slurmd (Debian's slurm-wlm and munge
packages), started as root with a generated ``slurm.conf`` for localhost on free ports.

One node (``localhost``) by default; ``start(..., nodes=[...])`` runs one slurmd per name on this
host (``slurmd -N NAME``, each on its own port, spool, pid and log), which Slurm allows when built
with ``--enable-multiple-slurmd`` (``scontrol show config`` then says ``MULTIPLE_SLURMD = Yes``;
Debian's 22.05 package is). Every node has NodeAddr 127.0.0.1; the first node's name must resolve
to this host (the jobs reach their rendezvous by it: this machine's hostname), the others are
Slurm's names only. Not ``localhost`` with other nodes: slurmctld then stops with "fatal:
Duplicated NodeHostName".

Everything lives in one temporary folder (key, sockets, state, logs); ``SLURM_CONF`` points the
client commands (sbatch, scontrol, scancel) and the jobs at it. Nothing is faked.

Two settings make Slurm react sooner than its defaults, which only the tests' waiting needs:

- ``AuthInfo=...,cred_expire=10`` (default 120, Slurm's minimum 5): a requeued job's begin time is
  the credential lifetime + 1 s after the requeue. Each credential is checked once, when slurmd
  gets the launch it came with (sent at once), so 10 s is ample even on a loaded machine.
- ``SchedulerParameters=bf_interval=1,sched_interval=1`` (defaults 30 and 60): nothing wakes the
  scheduler when a requeued job's begin time passes, so it started on the next periodic pass, up
  to 30 s later (26 s measured); with a pass every second it starts at its begin time. A pass
  over this cluster's one or two jobs is cheap.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "srun")


def missing_programs() -> list[str]:
    return [p for p in PROGRAMS if shutil.which(p) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_job_id() -> int:
    """A random first job id: two test clusters running at once (pytest-xdist) would otherwise
    both number their jobs from 1, and start probing for a rendezvous port at the same one."""
    return 1 + int.from_bytes(os.urandom(2), "big") % 9000


CONF = """\
ClusterName=corelooper-test
FirstJobId={first_job_id}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket,cred_expire=10
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=30
SlurmdTimeout={slurmd_timeout}
InactiveLimit=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
{node_lines}
PartitionName=debug Nodes={node_names} Default=YES MaxTime=INFINITE State=UP
"""
NODE = "NodeName={name} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} RealMemory=1000 State=UNKNOWN"


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]
    processes: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait_for(self, what: str, check, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.5)
        raise TimeoutError(f"{what} after {timeout} s; logs in {self.root}:\n{self.logs()}")

    def restart_slurmd(self, node: str) -> None:
        """Start the node's slurmd again (after a test killed it: the node comes back)."""
        log = open(self.root / f"slurmd-{node}.out", "a")  # noqa: SIM115 - kept open for the daemon's life
        self.processes.append(
            subprocess.Popen(["slurmd", "-D", "-N", node], env=self.env, stdout=log, stderr=subprocess.STDOUT)
        )

    def slurmd(self, node: str) -> subprocess.Popen:
        return next(p for p in reversed(self.processes) if p.args == ["slurmd", "-D", "-N", node])

    def logs(self) -> str:
        tails = []
        for path in [
            self.root / "munged.log",
            self.root / "slurmctld.log",
            *sorted(self.root.glob("slurmd-*.log")),
        ]:
            if path.exists():
                tails.append(
                    f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:])
                )
        return "\n".join(tails)

    def stop(self) -> None:
        try:
            self.run("scancel", "--user=root", timeout=10)
        except subprocess.TimeoutExpired:  # slurmctld is gone: the daemons are stopped all the same
            pass
        for proc in reversed(self.processes):  # only what this fixture started, by its pid
            proc.terminate()
        for proc in reversed(self.processes):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _controller_up(cluster: SlurmCluster) -> bool:
    controller = cluster.processes[1]
    if controller.poll() is not None:  # e.g. "fatal: ..." in a config it refuses: say so now
        raise RuntimeError(
            f"slurmctld exited with {controller.returncode}; logs in {cluster.root}:\n{cluster.logs()}"
        )
    ping = cluster.run("scontrol", "ping")
    return ping.returncode == 0 and "UP" in ping.stdout


def start(
    root: Path, env: dict[str, str], nodes: tuple[str, ...] = ("localhost",), slurmd_timeout: int = 300
) -> SlurmCluster:
    """munged -> slurmctld -> one slurmd per node, each in the foreground of a child process.
    Several nodes share this host's CPUs (each gets all of them: the tests run one small task per node).
    ``slurmd_timeout``: seconds before slurmctld sets a silent node DOWN (Slurm's default 300)."""
    for sub in ("state", *(f"spool-{n}" for n in nodes)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    cpus = os.cpu_count() or 1
    node_lines = "\n".join(NODE.format(name=n, port=_free_port(), cpus=cpus) for n in nodes)
    conf.write_text(
        CONF.format(
            root=root,
            ctld_port=_free_port(),
            slurmd_port=_free_port(),
            node_lines=node_lines,
            node_names=",".join(nodes),
            slurmd_timeout=slurmd_timeout,
            first_job_id=_first_job_id(),
        )
    )
    cluster = SlurmCluster(root, {**env, "SLURM_CONF": str(conf)})
    commands = [
        [
            "munged",
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={root}/munge.socket",
            f"--pid-file={root}/munged.pid",
            f"--log-file={root}/munged.log",
            f"--seed-file={root}/munged.seed",
        ],
        ["slurmctld", "-D", "-c", "-i"],
        *(["slurmd", "-D", "-N", n] for n in nodes),
    ]
    try:
        for i, cmd in enumerate(commands):
            name = f"slurmd-{cmd[-1]}" if cmd[0] == "slurmd" else cmd[0]
            log = open(root / f"{name}.out", "w")  # noqa: SIM115 - kept open for the daemon's life
            cluster.processes.append(
                subprocess.Popen(cmd, env=cluster.env, stdout=log, stderr=subprocess.STDOUT)
            )
            if i == 0:
                cluster.wait_for("munged did not start", (root / "munge.socket").exists, 20)
            if i == 1:
                cluster.wait_for("slurmctld did not answer", lambda: _controller_up(cluster), 60)
        cluster.wait_for(
            "the nodes did not become idle",
            lambda: cluster.run("sinfo", "-h", "-N", "-o", "%T").stdout.split().count("idle") == len(nodes),
            90,
        )
    except BaseException:
        cluster.stop()
        raise
    return cluster


def rendezvous_ports(log: str, job_id: str) -> list[int]:
    """The rendezvous port of each start of the job, as its log names them; each is the plugin's
    default (the first free one from 15000 + job id % 10000)."""
    ports = [
        int(p)
        for p in re.findall(
            rf"corelooper-slurm: job {job_id} \(restart \d+\) on .*; rendezvous \S+:(\d+)", log
        )
    ]
    first = 15000 + int(job_id) % 10000
    assert ports and all(first <= p < first + 100 for p in ports), (first, ports, log[-3000:])
    return ports
