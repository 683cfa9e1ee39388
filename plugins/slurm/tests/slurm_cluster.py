"""A real single-node Slurm on this machine: munged, slurmctld and slurmd (Debian's slurm-wlm and
munge packages), started as root with a generated ``slurm.conf`` for localhost on free ports.

Everything lives in one temporary folder (key, sockets, state, logs); ``SLURM_CONF`` points the
client commands (sbatch, scontrol, scancel) and the jobs at it. Nothing is faked.
"""

from __future__ import annotations

import os
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


CONF = """\
ClusterName=corelooper-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=30
InactiveLimit=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


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

    def logs(self) -> str:
        tails = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log"):
            path = self.root / name
            if path.exists():
                tails.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(tails)

    def stop(self) -> None:
        self.run("scancel", "--user=root", timeout=10)
        for proc in reversed(self.processes):  # only what this fixture started, by its pid
            proc.terminate()
        for proc in reversed(self.processes):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start(root: Path, env: dict[str, str]) -> SlurmCluster:
    """munged -> slurmctld -> slurmd, each in the foreground of a child process."""
    for sub in ("state", "spool"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(CONF.format(root=root, ctld_port=_free_port(), slurmd_port=_free_port(),
                                cpus=os.cpu_count() or 1))
    cluster = SlurmCluster(root, {**env, "SLURM_CONF": str(conf)})
    commands = [
        ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={root}/munge.socket",
         f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed"],
        ["slurmctld", "-D", "-c", "-i"],
        ["slurmd", "-D", "-N", "localhost"],
    ]
    try:
        for i, cmd in enumerate(commands):
            log = open(root / f"{cmd[0]}.out", "w")  # noqa: SIM115 - kept open for the daemon's life
            cluster.processes.append(subprocess.Popen(cmd, env=cluster.env, stdout=log, stderr=subprocess.STDOUT))
            if i == 0:
                cluster.wait_for("munged did not start", (root / "munge.socket").exists, 20)
            if i == 1:
                cluster.wait_for("slurmctld did not answer", lambda: cluster.run("scontrol", "ping").returncode == 0
                                 and "UP" in cluster.run("scontrol", "ping").stdout, 60)
        cluster.wait_for("the node did not become idle", lambda: "idle" in cluster.run(
            "sinfo", "-h", "-o", "%T").stdout, 90)
    except BaseException:
        cluster.stop()
        raise
    return cluster
