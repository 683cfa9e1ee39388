"""Every Kubernetes manifest docs/clusters.md shows, validated as a cluster would.

No Kubernetes cluster runs here, so the API server's check is done with its schemas: core objects
(the PersistentVolumeClaim, and each pod template as a ``PodTemplate``) with kubernetes-validate
(the schemas of a Kubernetes release), the Kubeflow custom resources (PyTorchJob, TrainJob)
against the ``openAPIV3Schema`` of their CRDs, kept in tests/data/kubeflow/ (README there). Then
what corelooper needs from them: output_dir on a ReadWriteMany volume every pod mounts, a sized
memory-backed /dev/shm, and the rendezvous left to the operator (``PET_*`` variables).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")  # in the [test] extra
jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "clusters.md"
CRDS = REPO / "tests" / "data" / "kubeflow"
K8S_VERSION = "1.33"  # a release kubernetes-validate ships schemas for
RESERVED_PET = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
RDZV_FLAGS = ("--nnodes", "--nproc_per_node", "--nproc-per-node", "--node_rank", "--node-rank", "--rdzv",
              "--master_addr", "--master-addr", "--master_port", "--master-port", "--standalone")


def doc_manifests() -> list[dict]:
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
    return [yaml.safe_load(b) for b in blocks]


def by_kind(kind: str) -> dict:
    found = [m for m in doc_manifests() if m["kind"] == kind]
    assert len(found) == 1, f"docs/clusters.md shows {len(found)} {kind} manifests"
    return found[0]


def crd_schema(name: str) -> dict:
    return json.loads((CRDS / f"{name}.schema.json").read_text())


def pod_templates(manifest: dict) -> list[dict]:
    """The pod templates (``{spec: PodSpec}``) a PyTorchJob or TrainJob gives its pods."""
    if manifest["kind"] == "PyTorchJob":
        return [r["template"] for r in manifest["spec"]["pytorchReplicaSpecs"].values()]
    jobs = [j for p in manifest["spec"]["runtimePatches"]
            for j in p["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]]
    return [j["template"]["spec"]["template"] for j in jobs]


def validate_core(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_doc_shows_the_manifests_this_file_checks():
    kinds = sorted(m["kind"] for m in doc_manifests())
    assert kinds == ["PersistentVolumeClaim", "PyTorchJob", "TrainJob"]


def test_core_objects_validate_against_the_kubernetes_schemas():
    validate_core(by_kind("PersistentVolumeClaim"))
    for job in ("PyTorchJob", "TrainJob"):
        for template in pod_templates(by_kind(job)):
            spec = json.loads(json.dumps(template["spec"]))
            if job == "TrainJob":  # a patch: the runtime supplies the image
                for c in spec["containers"]:
                    c.setdefault("image", "from-the-runtime")
            validate_core({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                           "template": {"spec": spec}})


def test_a_wrong_field_is_caught_so_the_checks_can_fail():
    claim = json.loads(json.dumps(by_kind("PersistentVolumeClaim")))
    claim["spec"]["accessMode"] = claim["spec"].pop("accessModes")
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core(claim)
    job = json.loads(json.dumps(by_kind("PyTorchJob")))
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "three"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(job, crd_schema("pytorchjob")["openAPIV3Schema"])


@pytest.mark.parametrize(("kind", "name", "api"), [("PyTorchJob", "pytorchjob", "kubeflow.org/v1"),
                                                   ("TrainJob", "trainjob", "trainer.kubeflow.org/v1alpha1")])
def test_kubeflow_jobs_validate_against_their_crd_schema(kind, name, api):
    manifest, crd = by_kind(kind), crd_schema(name)
    assert manifest["apiVersion"] == f"{crd['group']}/{crd['version']}" == api and crd["kind"] == kind
    jsonschema.validate(manifest, crd["openAPIV3Schema"])


@pytest.mark.parametrize("kind", ["PyTorchJob", "TrainJob"])
def test_every_pod_mounts_the_shared_output_dir_and_a_sized_dev_shm(kind):
    claim = by_kind("PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for template in pod_templates(by_kind(kind)):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        (container,) = template["spec"]["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        runs = volumes[mounts["/runs"]]
        assert runs["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]
        assert shm["medium"] == "Memory" and shm["sizeLimit"].endswith("Gi")
        assert template["spec"]["terminationGracePeriodSeconds"] > 170  # > torchrun's --shutdown_timeout


@pytest.mark.parametrize(("kind", "container"), [("PyTorchJob", "pytorch"), ("TrainJob", "node")])
def test_the_rendezvous_is_left_to_the_operator(kind, container):
    """The operators inject PET_* into the container of that name; torchrun reads them when no
    flag overrides them (tests/test_multinode.py runs a node configured only by PET_*)."""
    manifest = by_kind(kind)
    command = manifest["spec"]["trainer"]["command"] if kind == "TrainJob" else None
    for template in pod_templates(manifest):
        (c,) = template["spec"]["containers"]
        assert c["name"] == container
        command = command or c["command"]
        assert not RESERVED_PET & {e["name"] for e in c.get("env", [])}
    env = manifest["spec"].get("trainer", {}).get("env", [])
    assert not RESERVED_PET & {e["name"] for e in env}
    assert command[0] == "torchrun" and command[command.index("-m") + 1:][:2] == ["corelooper", "run"]
    assert not [a for a in command if a.startswith(RDZV_FLAGS)], command
    assert command[command.index("--resume-from-checkpoint") + 1] == "auto"
    shutdown = int(command[command.index("--shutdown_timeout") + 1])
    assert 0 < shutdown < 180
