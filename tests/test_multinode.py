"""Two "nodes" on one machine: two torchrun agents (``--nnodes 2 --nproc_per_node 1``) meeting
through a c10d rendezvous on 127.0.0.1, as two hosts of a cluster would, against one torchrun
with two processes on one node. Same world size, same samples: the final weights agree to 1e-5.
The second agent reads its settings from ``PET_*`` variables (torchrun's environment form, used
by Kubernetes operators), the first from flags."""

from __future__ import annotations

import subprocess
import uuid

import pytest
from cluster_task import REPO, env, free_port, max_diff, torchrun, write_config
from safetensors.torch import load_file

pytestmark = pytest.mark.cluster  # starts a scheduler or rehearses a cluster

TIMEOUT = 240


def _corelooper(config) -> list[str]:
    return ["-m", "corelooper", "run", str(config)]


@pytest.mark.slow
def test_two_nodes_match_one_node_with_the_same_world_size(tmp_path):
    nodes_cfg = write_config(tmp_path, tmp_path / "nodes", name="nodes.toml")
    one_cfg = write_config(tmp_path, tmp_path / "one", name="one.toml")
    port, run_id = free_port(), uuid.uuid4().hex
    settings = {
        "nnodes": "2",
        "nproc_per_node": "1",
        "rdzv_backend": "c10d",
        "rdzv_endpoint": f"127.0.0.1:{port}",
        "rdzv_id": run_id,
        "max_restarts": "0",
    }
    flags = [x for k, v in settings.items() for x in (f"--{k}", v)]
    # Node 0 gets flags; node 1 the same settings as PET_* variables, which is how the Kubeflow
    # operators (PyTorchJob, TrainJob) hand them to a plain `torchrun` in each pod.
    pet = {f"PET_{k.upper()}": v for k, v in {**settings, "node_rank": "1"}.items()}
    commands = [
        ([*torchrun(), *flags, "--node_rank", "0", *_corelooper(nodes_cfg)], {}),
        ([*torchrun(), *_corelooper(nodes_cfg)], pet),
    ]
    agents = [
        subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**env(tmp_path), **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for cmd, extra in commands
    ]
    outputs = [a.communicate(timeout=TIMEOUT) for a in agents]
    for agent, (_, err) in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, err[-4000:]
    stdout = "".join(out for out, _ in outputs)
    assert "x 2 processes" in stdout  # one job of world size 2, not two jobs of one
    assert stdout.count("corelooper: training") == 1  # one rank speaks, across both nodes

    one = subprocess.run(
        [*torchrun(), "--standalone", "--nproc_per_node", "2", *_corelooper(one_cfg)],
        cwd=REPO,
        env=env(tmp_path),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert one.returncode == 0, one.stderr[-4000:]

    nodes = load_file(str(tmp_path / "nodes" / "model.safetensors"))
    single = load_file(str(tmp_path / "one" / "model.safetensors"))
    assert max_diff(nodes, single) <= 1e-5
    start = load_file(str(tmp_path / "nodes" / "checkpoint-3" / "model.safetensors"))
    assert max_diff(nodes, start) > 1e-3  # it trained: the comparison is not of two untouched models
