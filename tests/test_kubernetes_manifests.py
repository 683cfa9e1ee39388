"""Every Kubernetes manifest docs/clusters.md shows, validated as a cluster would.

No Kubernetes cluster runs here, so the API server's check is done with its schemas: core objects
(the PersistentVolumeClaim, and each pod template as a ``PodTemplate``) with kubernetes-validate
(the schemas of a Kubernetes release); the Kubeflow custom resources with the models Kubeflow
publishes on PyPI (both in the [test] extra): the TrainJob with ``kubeflow-trainer-api`` (pydantic
models generated from the Trainer's OpenAPI spec), the PyTorchJob with ``kubeflow-training`` (the
Training Operator v1 SDK). Both drop the fields they do not know, so a manifest passes when
loading it checks the types and writing it back gives the manifest again, at every depth. Then
what corelooper needs from them: output_dir on a ReadWriteMany volume every pod mounts, a sized
memory-backed /dev/shm, and the rendezvous left to the operator (``PET_*`` variables).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster  # starts a scheduler or rehearses a cluster

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")  # the [test] extra, as the next three
pydantic = pytest.importorskip("pydantic")
trainer_api = pytest.importorskip("kubeflow_trainer_api.models.trainer_v1alpha1_train_job")
training_api = pytest.importorskip("kubeflow.training.api_client")  # kubeflow-training
training_constants = pytest.importorskip("kubeflow.training.constants.constants")

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "clusters.md"
K8S_VERSION = "1.33"  # a release kubernetes-validate ships schemas for
RESERVED_PET = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
RDZV_FLAGS = (
    "--nnodes",
    "--nproc_per_node",
    "--nproc-per-node",
    "--node_rank",
    "--node-rank",
    "--rdzv",
    "--master_addr",
    "--master-addr",
    "--master_port",
    "--master-port",
    "--standalone",
)


def doc_manifests() -> list[dict]:
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
    return [yaml.safe_load(b) for b in blocks]


def by_kind(kind: str) -> dict:
    found = [m for m in doc_manifests() if m["kind"] == kind]
    assert len(found) == 1, f"docs/clusters.md shows {len(found)} {kind} manifests"
    return found[0]


def round_trip(manifest: dict) -> dict:
    """The manifest loaded by its Kubeflow package's models and written back: a type the schema
    does not allow raises (pydantic's ``ValidationError``, ``ValueError``), a field it does not
    know is missing from the result."""
    if manifest["kind"] == "TrainJob":
        return trainer_api.TrainerV1alpha1TrainJob.from_dict(copy.deepcopy(manifest)).to_dict()
    data = copy.deepcopy(manifest)
    # The SDK's PyTorchJobSpec requires runPolicy, which the CRD leaves optional (the operator
    # fills in its defaults): lend an empty one and take it back.
    lent = "runPolicy" not in data["spec"]
    if lent:
        data["spec"]["runPolicy"] = {}
    with training_api.ApiClient() as client:
        written = client.sanitize_for_serialization(
            client._ApiClient__deserialize(data, "KubeflowOrgV1PyTorchJob")
        )
    if lent:
        assert written["spec"].pop("runPolicy") == {}
    return written


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_quantity(path: tuple) -> bool:
    """A Kubernetes quantity (resources limits/requests, emptyDir sizeLimit) may be a JSON number:
    the API server takes 8, while kubeflow-training types quantities ``str`` and writes "8"."""
    return path[-1:] == ("sizeLimit",) or path[-2:-1] in (("limits",), ("requests",))


def differences(want, got, path: tuple = ()) -> list[str]:
    """Where ``got`` (the round trip) differs from ``want`` (the manifest), as key paths."""
    where = "/" + "/".join(map(str, path))
    if isinstance(want, dict) and isinstance(got, dict):
        return [
            d
            for k in sorted(want.keys() | got.keys())
            for d in (
                differences(want[k], got[k], (*path, k))
                if k in want and k in got
                else [f"{where.rstrip('/')}/{k}: {'dropped' if k in want else 'added'}"]
            )
        ]
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [
            d for i, (w, g) in enumerate(zip(want, got, strict=True)) for d in differences(w, g, (*path, i))
        ]
    if type(want) is type(got) and want == got or is_number(want) and is_number(got) and want == got:
        return []  # 8 and 8.0 are one JSON number
    if is_number(want) and got == str(want) and is_quantity(path):
        return []
    return [f"{where}: {want!r} became {got!r}"]


def pod_templates(manifest: dict) -> list[dict]:
    """The pod templates (``{spec: PodSpec}``) a PyTorchJob or TrainJob gives its pods."""
    if manifest["kind"] == "PyTorchJob":
        return [r["template"] for r in manifest["spec"]["pytorchReplicaSpecs"].values()]
    jobs = [
        j
        for p in manifest["spec"]["runtimePatches"]
        for j in p["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    ]
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
            validate_core(
                {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": "t"},
                    "template": {"spec": spec},
                }
            )


def test_a_wrong_field_is_caught_so_the_checks_can_fail():
    claim = json.loads(json.dumps(by_kind("PersistentVolumeClaim")))
    claim["spec"]["accessMode"] = claim["spec"].pop("accessModes")
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core(claim)
    job = json.loads(json.dumps(by_kind("PyTorchJob")))
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "three"
    with pytest.raises(ValueError, match="three"):
        round_trip(job)
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "3"  # int("3") loads: the round trip tells
    assert differences(job, round_trip(job)) == ["/spec/pytorchReplicaSpecs/Worker/replicas: '3' became 3"]
    train = json.loads(json.dumps(by_kind("TrainJob")))
    train["spec"]["trainer"]["numNodes"] = "four"
    with pytest.raises(pydantic.ValidationError, match="numNodes"):
        round_trip(train)


@pytest.mark.parametrize("kind", ["PyTorchJob", "TrainJob"])
def test_a_misspelt_field_deep_in_a_pod_template_is_caught(kind):
    job = json.loads(json.dumps(by_kind(kind)))
    spec = pod_templates(job)[0]["spec"]
    spec["terminationGracePeriodSecond"] = spec.pop("terminationGracePeriodSeconds")
    (found,) = differences(job, round_trip(job))
    assert found.endswith("/template/spec/terminationGracePeriodSecond: dropped"), found


@pytest.mark.parametrize(
    ("kind", "api"),
    [("PyTorchJob", training_constants.API_VERSION), ("TrainJob", "trainer.kubeflow.org/v1alpha1")],
)
def test_kubeflow_jobs_validate_against_their_published_schema(kind, api):
    manifest = by_kind(kind)
    assert (manifest["apiVersion"], manifest["kind"]) == (api, kind)
    assert differences(manifest, round_trip(manifest)) == []


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
    assert command[0] == "torchrun" and command[command.index("-m") + 1 :][:2] == ["corelooper", "run"]
    assert not [a for a in command if a.startswith(RDZV_FLAGS)], command
    assert command[command.index("--resume-from-checkpoint") + 1] == "auto"
    shutdown = int(command[command.index("--shutdown_timeout") + 1])
    assert 0 < shutdown < 180
