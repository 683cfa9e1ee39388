"""`corelooper slurm --nodes 2` on a real two-node Slurm: two slurmd "nodes" on this host
(``slurmd -N``; Debian's slurm-wlm is built with ``--enable-multiple-slurmd``), one task per node,
each running torchrun's agent with one rank, meeting at the first node's rendezvous. The job
finishes and its weights and every step's loss equal ``corelooper run --nproc 2``.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import slurm_cluster  # noqa: E402
from test_slurm import STEPS, _losses, base_env, corelooper, write_config  # noqa: E402

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
    cluster = slurm_cluster.start(root, base_env(root), nodes=NODES)
    yield cluster
    cluster.stop()


def test_this_slurm_runs_several_slurmd_on_one_host(slurm2):
    """docs/clusters.md: Debian's slurm-wlm is built with --enable-multiple-slurmd."""
    config = slurm2.run("scontrol", "show", "config").stdout
    assert any(line.split() == ["MULTIPLE_SLURMD", "=", "Yes"] for line in config.splitlines()), config
    nodes = slurm2.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.split("\n")
    assert sorted(line.split() for line in nodes if line) == sorted([[HEAD, "idle"], [SECOND, "idle"]])


def test_a_two_node_job_equals_two_processes_on_one_node(slurm2, tmp_path):
    config = write_config(tmp_path / "job.toml", tmp_path / "job")
    env = {**slurm2.env, "TMPDIR": str(tmp_path)}
    submitted = corelooper("slurm", str(config), "--nodes", "2", "--nproc-per-node", "1",
                           "--output", str(tmp_path / "job-%j.out"), "-p", "no:tensorboard", env=env, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().rsplit(" ", 1)[-1]
    slurm2.wait_for("the job did not end", lambda: slurm2.job(job_id).get("JobState") in ("COMPLETED", "FAILED"), 240)
    job, log = slurm2.job(job_id), (tmp_path / f"job-{job_id}.out").read_text()
    assert (job["JobState"], job["NumNodes"], job["NodeList"]) == ("COMPLETED", "2", f"{HEAD},{SECOND}"), (job, log)
    port = 20000 + int(job_id) % 20000
    assert (f"corelooper-slurm: job {job_id} (restart 0) on {HEAD},{SECOND}: starting fresh (no checkpoint yet); "
            f"rendezvous {HEAD}:{port}") in log, log
    for node in NODES:  # one line per node: each ran its task, and its rank finished
        assert f"corelooper-slurm: node {node} (" in log and "): finished; every rank finished" in log, log
    assert log.count("): finished; every rank finished") == 2, log
    assert "x 2 processes" in log, log  # one job of world size 2, not two runs of 1

    ref = corelooper("run", str(write_config(tmp_path / "ref.toml", tmp_path / "ref")), "--nproc", "2",
                     "-p", "no:tensorboard", env=base_env(tmp_path))
    assert ref.returncode == 0, ref.stderr[-3000:]
    final, want = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("job", "ref"))
    assert max((final[k] - want[k]).abs().max().item() for k in want) <= 1e-5
    got, expected = (_losses(tmp_path / d / "metrics.jsonl") for d in ("job", "ref"))
    assert sorted(got) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - expected[s]) for s in expected) <= 1e-5
