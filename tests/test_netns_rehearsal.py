"""The 2-node rehearsal across a real network interface: each "node" in its own Linux network
namespace (``ip netns``), joined by a veth pair with private addresses this test makes and
removes. The c10d rendezvous and gloo's collectives cross that link (each namespace has only its
loopback and its end of the pair); the checkpoint writes go to the one file system both share
(as a cluster's shared file system would be; no NFS server here). Same weights as one node with
2 processes.

Needs root with CAP_NET_ADMIN (``ip netns add``): skipped, saying so, where that is refused.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid

import pytest
from cluster_task import REPO, env, max_diff, torchrun, write_config
from safetensors.torch import load_file

pytestmark = pytest.mark.cluster  # starts a scheduler or rehearses a cluster

TIMEOUT = 240
SUBNET = "10.213.{}.{}"  # a private /30 made up for this test, inside its own namespaces only


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


@pytest.fixture
def two_namespaces():
    """``(ns0, addr0, dev0), (ns1, addr1, dev1)``, torn down after the test."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed (apt-get install iproute2)")
    tag = uuid.uuid4().hex[:6]
    names, devs = (f"cl{tag}a", f"cl{tag}b"), (f"vcl{tag}a", f"vcl{tag}b")
    probe = _ip("netns", "add", names[0], check=False)
    if probe.returncode != 0:
        pytest.skip(
            f"network namespaces cannot be made here (`ip netns add`: {probe.stderr.strip()}); "
            "needs root with CAP_NET_ADMIN and CAP_SYS_ADMIN"
        )
    try:
        _ip("netns", "add", names[1])
        _ip("link", "add", devs[0], "type", "veth", "peer", "name", devs[1])
        nodes = []
        for i, (ns, dev) in enumerate(zip(names, devs, strict=True)):
            addr = SUBNET.format(7, i + 1)
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            nodes.append((ns, addr, dev))
        yield nodes
    finally:
        for ns in names:
            _ip("netns", "del", ns, check=False)  # deleting a namespace deletes its veth end


@pytest.mark.slow
def test_two_nodes_in_network_namespaces_match_one_node_with_two_processes(tmp_path, two_namespaces):
    (ns0, addr0, dev0), (ns1, _, dev1) = two_namespaces
    nodes_cfg = write_config(tmp_path, tmp_path / "nodes", name="nodes.toml")
    run_id = uuid.uuid4().hex
    agents = []
    for rank, (ns, dev) in enumerate(((ns0, dev0), (ns1, dev1))):
        cmd = [
            "ip",
            "netns",
            "exec",
            ns,
            *torchrun(),
            "--nnodes",
            "2",
            "--nproc_per_node",
            "1",
            "--node_rank",
            str(rank),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            f"{addr0}:29400",
            "--rdzv_id",
            run_id,
            "--rdzv_conf",
            f"is_host={int(rank == 0)}",  # the hostname is not
            # the namespace's address, so torchrun cannot tell by itself which node hosts the store
            "--max_restarts",
            "0",
            "--local_addr",
            SUBNET.format(7, rank + 1),
            "-m",
            "corelooper",
            "run",
            str(nodes_cfg),
        ]
        # gloo binds to the namespace's end of the veth pair, not to what the hostname resolves to
        agents.append(
            subprocess.Popen(
                cmd,
                cwd=REPO,
                env={**env(tmp_path), "GLOO_SOCKET_IFNAME": dev},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [a.communicate(timeout=TIMEOUT) for a in agents]
    for agent, (_, err) in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, err[-4000:]
    assert "x 2 processes" in "".join(out for out, _ in outputs)

    one_cfg = write_config(tmp_path, tmp_path / "one", name="one.toml")
    one = subprocess.run(
        [*torchrun(), "--standalone", "--nproc_per_node", "2", "-m", "corelooper", "run", str(one_cfg)],
        cwd=REPO,
        env=env(tmp_path),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert one.returncode == 0, one.stderr[-4000:]
    nodes = load_file(str(tmp_path / "nodes" / "model.safetensors"))
    assert max_diff(nodes, load_file(str(tmp_path / "one" / "model.safetensors"))) <= 1e-5
    assert max_diff(nodes, load_file(str(tmp_path / "nodes" / "checkpoint-3" / "model.safetensors"))) > 1e-3
