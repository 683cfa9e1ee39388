"""`corelooper slurm --nodes 2` on a real two-node Slurm: two slurmd "nodes" on this host
(``slurmd -N``; Debian's slurm-wlm is built with ``--enable-multiple-slurmd``), one task per node,
each running torchrun's agent with one rank, meeting at the first node's rendezvous. The job
finishes and its weights and every step's loss equal ``corelooper run --nproc 2``: one run of
the same config for the whole module (``two_processes``), which the node-loss test also takes its
checkpoint from.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import slurm_cluster  # noqa: E402
from test_slurm import REPO, SLOW, STEPS, _losses, assert_every_line_is_labelled, base_env, corelooper  # noqa: E402

sys.path.insert(0, str(HERE.parents[2] / "tests"))  # the 2 -> 1 reference of tests/test_node_lost.py
from cluster_task import max_diff, write_config  # noqa: E402
from test_node_lost import RESUMED  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.distributed]  # a two-node Slurm; every job forms a group

# The jobs reach their first node (in Slurm's sorted node list) by its name, the rendezvous
# endpoint: this machine's hostname. The second node's name is only Slurm's (slurmd is reached at
# NodeAddr=127.0.0.1) and sorts after it. Not "localhost": slurmctld refuses it next to another
# node on the same host ("fatal: Duplicated NodeHostName").
HEAD = socket.gethostname()
SECOND = f"{HEAD}-2"
NODES = (HEAD, SECOND)


def _head_resolves() -> bool:
    try:
        return HEAD != "localhost" and bool(socket.getaddrinfo(HEAD, None))
    except OSError:
        return False


@pytest.fixture(scope="module")
def slurm2(tmp_path_factory):
    missing = slurm_cluster.missing_programs()
    if missing:  # the only reason to skip: scripts/setup installs them where it can (root + apt-get)
        pytest.skip(f"Slurm is not installed (missing {', '.join(missing)}): apt-get install slurm-wlm munge")
    if not _head_resolves():  # the rendezvous endpoint would not resolve; /etc/hosts usually names it
        pytest.skip(f"this machine's hostname {HEAD!r} does not resolve: add it to /etc/hosts")
    root = tmp_path_factory.mktemp("slurm2")
    # a node silent for 15 s is DOWN (Slurm's default 300 s): the node-failure test waits for it
    cluster = slurm_cluster.start(root, base_env(root), nodes=NODES, slurmd_timeout=15)
    yield cluster
    cluster.stop()


def _job_config(tmp_path: Path, output_dir: Path, name: str = "job.toml") -> Path:
    """The run every job here trains (24 steps, a checkpoint every 3): the reference's config."""
    return write_config(tmp_path, output_dir, name=name, max_steps=STEPS)


def _run_outside_slurm(tmp: Path, out: Path, name: str, *args: str):
    """``corelooper run`` of the jobs' config (written to ``tmp/name``, output ``out``) on this
    machine, not through Slurm: the references the jobs are compared with."""
    return corelooper(
        "run", str(_job_config(tmp, out, name)), *args, "-p", "no:tensorboard", env=base_env(tmp)
    )


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    """``corelooper run --nproc 2`` of that run, once for the module (a 2-process run is ~30 s of
    start-up on 2 cores): the output folder whose weights, per-step losses and checkpoints every
    job here is compared with (the tests only read it)."""
    tmp = tmp_path_factory.mktemp("two-processes")
    ref = _run_outside_slurm(tmp, tmp / "two", "two.toml", "--nproc", "2")
    assert ref.returncode == 0, ref.stderr[-3000:]
    return tmp / "two"


def _assert_equals_two_processes(job: Path, two: Path) -> None:
    """The job's final weights and every step's loss equal ``corelooper run --nproc 2``'s."""
    final, want = (load_file(str(d / "model.safetensors")) for d in (job, two))
    assert max((final[k] - want[k]).abs().max().item() for k in want) <= 1e-5
    got, expected = (_losses(d / "metrics.jsonl") for d in (job, two))
    assert sorted(got) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - expected[s]) for s in expected) <= 1e-5


def test_this_slurm_runs_several_slurmd_on_one_host(slurm2):
    """docs/clusters.md: Debian's slurm-wlm is built with --enable-multiple-slurmd."""
    config = slurm2.run("scontrol", "show", "config").stdout
    assert any(line.split() == ["MULTIPLE_SLURMD", "=", "Yes"] for line in config.splitlines()), config
    nodes = slurm2.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.split("\n")
    assert sorted(line.split() for line in nodes if line) == sorted([[HEAD, "idle"], [SECOND, "idle"]])


@pytest.mark.slow
def test_a_two_node_job_equals_two_processes_on_one_node(slurm2, two_processes, tmp_path):
    config = _job_config(tmp_path, tmp_path / "job")
    env = {**slurm2.env, "TMPDIR": str(tmp_path), **LOSS_RDZV}
    submitted = corelooper(
        "slurm",
        str(config),
        "--nodes",
        "2",
        "--nproc-per-node",
        "1",
        "--output",
        str(tmp_path / "job-%j.out"),
        "-p",
        "no:tensorboard",
        env=env,
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().rsplit(" ", 1)[-1]
    slurm2.wait_for(
        "the job did not end", lambda: slurm2.job(job_id).get("JobState") in ("COMPLETED", "FAILED"), 240
    )
    job, log = slurm2.job(job_id), (tmp_path / f"job-{job_id}.out").read_text()
    assert (job["JobState"], job["NumNodes"], job["NodeList"]) == ("COMPLETED", "2", f"{HEAD},{SECOND}"), (
        job,
        log,
    )
    [port] = slurm_cluster.rendezvous_ports(log, job_id)
    assert (
        f"corelooper-slurm: job {job_id} (restart 0) on {HEAD},{SECOND}: starting fresh (no checkpoint yet); "
        f"rendezvous {HEAD}:{port}"
    ) in log, log
    for node in NODES:  # one line per node: each ran its task, and its rank finished
        assert f"corelooper-slurm: node {node} (" in log and "): finished; every rank finished" in log, log
    assert log.count("): finished; every rank finished") == 2, log
    assert "x 2 processes" in log, log  # one job of world size 2, not two runs of 1
    # rank 0 speaks, labelled with its node (torchrun's rendezvous, not Slurm's node order, numbers them)
    assert (
        f"[{HEAD} rank 0]: corelooper: training " in log or f"[{SECOND} rank 0]: corelooper: training " in log
    )
    assert_every_line_is_labelled(log)
    _assert_equals_two_processes(tmp_path / "job", two_processes)


SRUN_JOB = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output={output}
{python} -c "import os; from corelooper_slurm.environment import srun_environment as e; print('batch:', e(os.environ))"
srun --kill-on-bad-exit=1 {python} -m corelooper run {config} -p no:tensorboard
"""


@pytest.mark.slow
def test_srun_corelooper_run_in_an_allocation_is_one_run_of_its_tasks(slurm2, two_processes, tmp_path):
    """issue 48: `srun corelooper run` started one 1-process run per task, and the run lock refused
    the second. Now each task is a rank (SLURM_PROCID of SLURM_STEP_NUM_TASKS, the first node of
    the step's node list hosting the store): one run of world size 2 whose weights and losses equal
    `corelooper run --nproc 2`'s."""
    config = _job_config(tmp_path, tmp_path / "job")
    script = tmp_path / "srun.sbatch"
    script.write_text(SRUN_JOB.format(output=tmp_path / "srun-%j.out", python=sys.executable, config=config))
    submitted = slurm2.run("sbatch", "--parsable", f"--chdir={REPO}", str(script))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    slurm2.wait_for(
        "the job did not end", lambda: slurm2.job(job_id).get("JobState") in ("COMPLETED", "FAILED"), 240
    )
    job, log = slurm2.job(job_id), (tmp_path / f"srun-{job_id}.out").read_text()
    assert (job["JobState"], job["ExitCode"], job["NodeList"]) == ("COMPLETED", "0:0", f"{HEAD},{SECOND}"), (
        job,
        log,
    )
    assert "x 2 processes" in log and "already holds a run" not in log, log
    assert "batch: {}" in log, log  # the batch script itself (2 tasks allocated) is no rank
    _assert_equals_two_processes(tmp_path / "job", two_processes)


def _kill_node_tasks(job_id: str, node: str, stepd: bool = False) -> list[int]:
    """kill -9 every process of the job's task on ``node`` (its torchrun agent and its rank): they
    carry SLURMD_NODENAME and SLURM_JOB_ID in their environment. ``stepd``: also the slurmstepd
    that started the task (the agent's parent), as when the node loses power."""
    want = {f"SLURMD_NODENAME={node}".encode(), f"SLURM_JOB_ID={job_id}".encode()}
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and want <= set((proc / "environ").read_bytes().split(b"\0"))
                and b"corelooper" in (proc / "cmdline").read_bytes()
            ):
                pids.append(int(proc.name))
                parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
                if stepd and Path(f"/proc/{parent}/cmdline").read_bytes().startswith(b"slurmstepd"):
                    pids.append(int(parent))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


# torchrun's rendezvous settings for the jobs that lose a node (corelooper_slurm.node keeps them
# beside is_host): the lost agent's heartbeat expires after 2 s x 3 instead of 5 s x 3, and the
# survivor's round closes 15 s after it instead of 30 (torch's defaults): ~25 s less waiting per
# test. The first round still waits up to 15 s for the second node's agent, which starts beside
# the first one.
LOSS_RDZV = {"PET_RDZV_CONF": "last_call_timeout=15,keep_alive_interval=2,keep_alive_max_attempt=3"}


@pytest.mark.slow
def test_a_node_lost_mid_job_the_other_resumes_alone_and_the_job_completes(slurm2, two_processes, tmp_path):
    """--min-nodes 1 --max-restarts 1: kill -9 the second node's task (agent and rank) after a
    checkpoint; the first node's agent re-rendezvous alone, its rank resumes the newest checkpoint
    on 1 process (same global batch, GA 1 -> 2), the job completes without a requeue, and the
    weights equal a run that changes world size 2 -> 1 at that checkpoint."""
    (tmp_path / "slow.py").write_text(SLOW)
    config = _job_config(tmp_path, tmp_path / "job")
    env = {**slurm2.env, "TMPDIR": str(tmp_path), **LOSS_RDZV}
    submitted = corelooper(
        "slurm",
        str(config),
        "--nodes",
        "2",
        "--min-nodes",
        "1",
        "--max-restarts",
        "1",
        "--nproc-per-node",
        "1",
        "--output",
        str(tmp_path / "job-%j.out"),
        "-p",
        str(tmp_path / "slow.py"),
        "-p",
        "no:tensorboard",
        env=env,
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().rsplit(" ", 1)[-1]
    log_path = tmp_path / f"job-{job_id}.out"
    slurm2.wait_for("the job saved no checkpoint", lambda: (tmp_path / "job" / "checkpoint-3").is_dir(), 240)
    assert _kill_node_tasks(job_id, SECOND), "no process of the job's task on the second node"
    slurm2.wait_for(
        "the job did not end", lambda: slurm2.job(job_id).get("JobState") in ("COMPLETED", "FAILED"), 300
    )
    job, log = slurm2.job(job_id), log_path.read_text()
    assert (job["JobState"], job["Restarts"], job["NodeList"]) == ("COMPLETED", "0", f"{HEAD},{SECOND}"), (
        job,
        log,
    )
    assert "x 2 processes" in log, log  # it started as one job of world size 2
    resumed = re.search(RESUMED.format(a=1, n=2, m=1, b=2), log)
    assert resumed, log[-6000:]
    lost_at = int(resumed.group(1))
    assert 3 <= lost_at < STEPS, log[-4000:]
    assert f"corelooper-slurm: node {SECOND}: lost; its task ended without a status" in log, log[-4000:]
    # the last worker group's statuses: its one rank (the first group's, stopped for the restart, not)
    head_line = rf"corelooper-slurm: node {HEAD} \(\S+ CPUs\): finished; every rank finished; rank 0: 0\n"
    assert re.search(head_line, log), log[-4000:]
    assert "corelooper-slurm: finished on 1 of 2 nodes (newest checkpoint-" in log, log[-4000:]
    assert "requeueing" not in log, log[-4000:]

    # the reference (as tests/test_node_lost.py builds it): 2 processes to the end (its
    # checkpoint-<lost_at> is the job's), then 1 process from that checkpoint to the end
    two = two_processes
    saved = f"checkpoint-{lost_at}/model.safetensors"
    assert max_diff(load_file(str(two / saved)), load_file(str(tmp_path / "job" / saved))) <= 1e-5
    (tmp_path / "ref").mkdir()
    shutil.copytree(two / f"checkpoint-{lost_at}", tmp_path / "ref" / f"checkpoint-{lost_at}")
    one = _run_outside_slurm(tmp_path, tmp_path / "ref", "ref.toml", "--resume-from-checkpoint", "latest")
    assert one.returncode == 0 and re.search(RESUMED.format(a=1, n=2, m=1, b=2), one.stdout + one.stderr), (
        one.stderr[-3000:]
    )
    final = load_file(str(tmp_path / "job" / "model.safetensors"))
    assert max_diff(final, load_file(str(tmp_path / "ref" / "model.safetensors"))) <= 1e-5
    assert max_diff(final, load_file(str(two / "model.safetensors"))) <= 1e-5  # same global batch
    assert max_diff(final, load_file(str(tmp_path / "job" / saved))) > 1e-3  # it trained on after the loss


@pytest.mark.slow
def test_a_failed_node_leaves_the_job_which_completes_and_does_not_rejoin_it(slurm2, tmp_path):
    """docs/clusters.md: a node failure as Slurm sees it (its slurmd, slurmstepd and processes
    gone: kill -9). With --no-kill slurmctld removes the node from the job when it stops answering
    (SlurmdTimeout) instead of ending the job; srun --no-kill keeps the step on the other node,
    which resumes alone; the node, back in service, is idle, not in the running job."""
    (tmp_path / "slow.py").write_text(SLOW)
    config = write_config(tmp_path, tmp_path / "job", name="job.toml", max_steps=2 * STEPS)
    submitted = corelooper(
        "slurm",
        str(config),
        "--nodes",
        "2",
        "--min-nodes",
        "1",
        "--nproc-per-node",
        "1",
        "--output",
        str(tmp_path / "job-%j.out"),
        "-p",
        str(tmp_path / "slow.py"),
        "-p",
        "no:tensorboard",
        env={**slurm2.env, "TMPDIR": str(tmp_path), **LOSS_RDZV},
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().rsplit(" ", 1)[-1]
    slurm2.wait_for("the job saved no checkpoint", lambda: (tmp_path / "job" / "checkpoint-3").is_dir(), 240)
    slurmd = slurm2.slurmd(SECOND)
    slurmd.kill()  # the node fails: its slurmd, then everything the job ran there
    slurmd.wait()
    assert len(_kill_node_tasks(job_id, SECOND, stepd=True)) == 3, (
        "agent, rank and slurmstepd of the second node"
    )

    def state(node: str) -> str:
        return dict(
            line.split() for line in slurm2.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.splitlines()
        )[node]

    slurm2.wait_for("the node was not set DOWN", lambda: state(SECOND).startswith("down"), 120)
    job = slurm2.job(job_id)
    assert (job["JobState"], job["NodeList"], job["NumNodes"]) == ("RUNNING", HEAD, "1"), job
    slurm2.restart_slurmd(SECOND)  # the node comes back (ReturnToService=2): idle, not in the job
    slurm2.wait_for("the node did not return", lambda: state(SECOND) == "idle", 60)
    running = slurm2.job(job_id)
    assert (running["JobState"], running["NodeList"]) == ("RUNNING", HEAD), (
        "the job ended before the node was back"
    )
    slurm2.wait_for(
        "the job did not end", lambda: slurm2.job(job_id).get("JobState") in ("COMPLETED", "FAILED"), 300
    )
    job, log = slurm2.job(job_id), (tmp_path / f"job-{job_id}.out").read_text()
    assert (job["JobState"], job["Restarts"], job["NodeList"]) == ("COMPLETED", "0", HEAD), (job, log[-4000:])
    assert re.search(RESUMED.format(a=1, n=2, m=1, b=2), log), log[-6000:]
    assert f"corelooper-slurm: node {SECOND}: lost; its task ended without a status" in log, log[-4000:]
    assert "corelooper-slurm: finished on 1 of 2 nodes (newest checkpoint-48)" in log, log[-4000:]
    assert f"Removing failed node {SECOND} from JobId={job_id}" in (slurm2.root / "slurmctld.log").read_text()
