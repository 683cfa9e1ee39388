"""A node lost mid-job, with torchrun's elastic agent (``--nnodes 1:2 --max-restarts 1``).

Two "nodes" on one machine: two torchrun agents, one rank each, meeting in a c10d rendezvous on
127.0.0.1. Mid-run the second node dies (``kill -9`` of its agent's whole process group: agent
and rank, as a node losing power). The survivor's rank fails on the dead peer, its agent
re-rendezvous alone (min 1 node) and starts the rank again, which resumes the newest checkpoint
(``--resume-from-checkpoint auto``) on 1 process with the same global batch. The final weights
equal an uninterrupted run that changes world size at that step: 2 processes up to the
checkpoint, 1 process from it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import uuid

from cluster_task import ELASTIC, REPO, env, free_port, max_diff, torchrun, write_config
from safetensors.torch import load_file

TIMEOUT = 240
SLOW = "import time\n\n\ndef on_step_end(state):\n    time.sleep(0.3)  # time to lose a node mid-run\n"


def _run(tmp_path, config, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [*torchrun(), "--standalone", "--nproc_per_node", str(nproc), "-m", "corelooper", "run", str(config), *extra]
    return subprocess.run(cmd, cwd=REPO, env=env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT)


def test_a_node_killed_mid_run_the_survivor_resumes_alone_and_matches(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW)
    config = write_config(tmp_path, tmp_path / "job", name="job.toml")
    port, run_id = free_port(), uuid.uuid4().hex
    agent = [*torchrun(), "--nnodes", "1:2", "--nproc_per_node", "1", "--max_restarts", "1",
             "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", run_id,
             "--rdzv_conf", "last_call_timeout=10", "-m", "corelooper", "run", str(config),
             "--resume-from-checkpoint", "auto", "-p", str(tmp_path / "slow.py"), *ELASTIC]
    survivor = subprocess.Popen(agent, cwd=REPO, env=env(tmp_path), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    time.sleep(1)  # the survivor hosts the rendezvous store (the node that dies must not); both
    # join the first round within its last call (10 s), so the job starts on 2 nodes
    lost = subprocess.Popen(agent, cwd=REPO, env=env(tmp_path), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        metrics = tmp_path / "job" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count('"loss"') >= 4):
            if survivor.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the 2-node job did not train: {survivor.communicate(timeout=30)[1][-4000:]}")
            time.sleep(0.2)
        os.killpg(lost.pid, signal.SIGKILL)  # the node dies: its agent and its rank at once
        lost.wait(timeout=30)
        out, err = survivor.communicate(timeout=TIMEOUT)
    finally:
        for proc in (survivor, lost):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert survivor.returncode == 0, err[-4000:]
    assert "x 2 processes" in out  # it did start as one job of world size 2
    resumed = re.search(r"resuming \S*checkpoint-(\d+), saved with .* x 2 processes = 8,\s+on 1 processes: "
                        r"4 per device x 2 accumulation x 1 processes = 8 \(global batch kept\)", out + err)
    assert resumed, (out + err)[-4000:]
    step = int(resumed.group(1))
    assert 3 <= step < 12

    # the reference: 2 processes to the end (its checkpoint-<step> is the job's), then 1 process from it
    two = _run(tmp_path, write_config(tmp_path, tmp_path / "two", name="two.toml"), 2)
    assert two.returncode == 0, two.stderr[-4000:]
    saved = load_file(str(tmp_path / "two" / f"checkpoint-{step}" / "model.safetensors"))
    assert max_diff(saved, load_file(str(tmp_path / "job" / f"checkpoint-{step}" / "model.safetensors"))) <= 1e-5
    (tmp_path / "one").mkdir()
    shutil.copytree(tmp_path / "two" / f"checkpoint-{step}", tmp_path / "one" / f"checkpoint-{step}")
    one = _run(tmp_path, write_config(tmp_path, tmp_path / "one", name="one.toml"), 1,
               "--resume-from-checkpoint", "latest", *ELASTIC)
    one_out = one.stdout + one.stderr
    assert one.returncode == 0 and f"checkpoint-{step}" in one_out, one_out[-4000:]

    final = load_file(str(tmp_path / "job" / "model.safetensors"))
    assert max_diff(final, load_file(str(tmp_path / "one" / "model.safetensors"))) <= 1e-5
    assert max_diff(final, saved) > 1e-3  # it trained after the loss: not two copies of the checkpoint
