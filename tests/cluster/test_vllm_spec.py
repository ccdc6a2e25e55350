"""A real vLLM DynamoGraph against the real control plane: the CRD (installed by our chart)
accepts the tensor-parallel example, the Deployments and pods the operator renders for it are
accepted by the apiserver in a namespace enforcing Pod Security "restricted", and invalid vLLM
settings are refused by the real schema and CEL rules with their messages (the same values
`load_graph` refuses: tests/operator/test_vllm_spec.py)."""

import copy
import json

import pytest
import yaml

from dynamograph.operator.config import OperatorConfig
from dynamograph.operator.manifests import Owner, desired_objects, discovery_name
from dynamograph.protocol.graph import GraphError, load_graph

from .conftest import WORKLOAD_IMAGE, get
from .controlplane import REPO

EXAMPLE = REPO / "examples" / "vllm-tp.yaml"


def example(namespace: str) -> dict:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"]["namespace"] = namespace
    return body


def dry_run(cp, obj: dict):
    return cp.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(obj), check=False)


def rendered_deployments(body: dict, namespace: str) -> list[dict]:
    graph = load_graph(body)
    owner = Owner(namespace=namespace, name=graph.name, uid="0")
    objects = desired_objects(graph, owner, OperatorConfig(image=WORKLOAD_IMAGE))
    return [o for o in objects if o["kind"] == "Deployment"]


def pod_of(deployment: dict, namespace: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": deployment["metadata"]["name"], "namespace": namespace},
        "spec": deployment["spec"]["template"]["spec"],
    }


def test_the_tensor_parallel_example_is_accepted_and_its_pods_are_restricted(
    control_plane, chart_release, namespace
):
    cp = control_plane
    body = example(namespace)
    # A dry run: what the apiserver would store (schema, CEL, pruning, defaults), without an
    # operator (the session's may run) making the objects rendered below.
    res = cp.kubectl(
        "apply", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(body), check=False
    )
    assert res.returncode == 0, res.stderr
    stored = json.loads(res.stdout)
    worker = stored["spec"]["services"]["worker"]
    # the fields survive the apiserver's pruning: the schema knows them
    assert worker["tensorParallelSize"] == 4
    assert (
        worker["engine"]["extraArgs"] == body["spec"]["services"]["worker"]["engine"]["extraArgs"]
    )
    assert stored["spec"]["model"]["cache"] == {"claimName": "hf-cache", "readOnly": False}

    cp.kubectl("create", "serviceaccount", discovery_name("llama70b"), "-n", namespace)
    deployments = rendered_deployments(body, namespace)
    assert {d["metadata"]["name"] for d in deployments} == {"llama70b-worker", "llama70b-epp"}
    for deployment in deployments:
        name = deployment["metadata"]["name"]
        res = dry_run(cp, deployment)
        assert res.returncode == 0, f"{name}: {res.stderr}"
        res = dry_run(cp, pod_of(deployment, namespace))
        assert res.returncode == 0 and "violate" not in res.stderr, f"{name}: {res.stderr}"
    worker = next(d for d in deployments if d["metadata"]["name"] == "llama70b-worker")
    created = json.loads(
        cp.kubectl(
            "create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(worker)
        ).stdout
    )
    engine = created["spec"]["template"]["spec"]["containers"][0]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "4"
    probe = engine["startupProbe"]
    assert created["spec"]["progressDeadlineSeconds"] >= (
        probe["periodSeconds"] * probe["failureThreshold"]
    )


def test_a_host_path_model_cache_needs_a_namespace_that_allows_it(
    control_plane, chart_release, namespace
):
    """hostPath volumes are refused by Pod Security baseline and restricted (as the field's
    description says); a PersistentVolumeClaim is not."""
    cp = control_plane
    body = example(namespace)
    body["spec"]["model"]["cache"] = {"hostPath": "/mnt/hf"}
    cp.kubectl("create", "serviceaccount", discovery_name("llama70b"), "-n", namespace)
    worker = next(
        d
        for d in rendered_deployments(body, namespace)
        if d["metadata"]["name"] == "llama70b-worker"
    )
    res = dry_run(cp, pod_of(worker, namespace))
    assert res.returncode != 0
    assert 'violates PodSecurity "restricted:latest"' in res.stderr, res.stderr
    assert 'volume "model-cache" uses restricted volume type "hostPath"' in res.stderr, res.stderr


def _worker(body: dict) -> dict:
    return body["spec"]["services"]["worker"]


INVALID = [
    (
        "extra arg we set",
        lambda b: _worker(b)["engine"]["extraArgs"].append("--max_model_len=4096"),
        "extraArgs: --max_model_len=4096 is a flag the operator sets itself",
    ),
    (
        "gpu count against the parallel sizes",
        lambda b: _worker(b)["resources"].update(gpu=2),
        "a vllm engine pod uses dataParallelSize × tensorParallelSize × pipelineParallelSize",
    ),
    (
        "tensor parallel on the mock",
        lambda b: b["spec"].update(backend="mock"),
        "are vllm settings; the mock backend simulates one device per rank",
    ),
    (
        "a Llama model without its tokenizer",
        lambda b: b["spec"]["model"].pop("tokenizer"),
        "model.tokenizer: with backend vllm a model other than Qwen's names its tokenizer",
    ),
    (
        "two model caches",
        lambda b: b["spec"]["model"]["cache"].update(hostPath="/mnt/hf"),
        "claimName: set exactly one of claimName and hostPath",
    ),
    (
        "multinode is reserved",
        lambda b: _worker(b).update(multinode={"nodeCount": 2}),
        "nodeCount: Invalid value: 2: spec.services.worker.multinode.nodeCount in body should "
        "be less than or equal to 1",
    ),
    (
        "gpu type twice",
        lambda b: _worker(b).update(nodeSelector={"nvidia.com/gpu.product": "NVIDIA-A100"}),
        "gpuType: sets nodeSelector nvidia.com/gpu.product; set one of the two",
    ),
    (
        "startup timeout on the epp",
        lambda b: b["spec"]["services"]["epp"].update(startupTimeoutSeconds=60),
        "sharedMemory, gpuType, startupTimeoutSeconds, multinode: only worker, prefill and "
        "decode services run an engine",
    ),
    (
        "a keyless toleration that is not Exists",
        lambda b: _worker(b)["tolerations"].append({"effect": "NoSchedule"}),
        "key: a toleration without a key needs operator Exists",
    ),
]


@pytest.mark.parametrize(("case", "mutate", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_vllm_settings_are_refused_by_the_crd(
    control_plane, chart_release, namespace, case, mutate, message
):
    cp = control_plane
    body = example(namespace)
    mutate(body)
    with pytest.raises(GraphError):  # the models refuse it too
        load_graph(copy.deepcopy(body))
    res = cp.kubectl("apply", "-f", "-", input=json.dumps(body), check=False)
    assert res.returncode != 0, f"{case}: accepted\n{res.stdout}"
    assert message in res.stderr, res.stderr
    assert get(cp, "dg", "llama70b", "-n", namespace) is None
