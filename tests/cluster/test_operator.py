"""The operator against a real control plane: our chart installed by helm, the operator running
with the chart's ServiceAccount token (RBAC enforced), graphs in namespaces that enforce Pod
Security "restricted", pods scheduled by the real scheduler onto kwok's fake Nodes, garbage
collection by the real controller-manager, and the CRD's schema and CEL rules checked by the
real apiserver."""

import ipaddress
import json
import subprocess

import pytest

from dynamograph.operator.config import OperatorConfig
from dynamograph.operator.manifests import Owner, desired_objects, discovery_name
from dynamograph.protocol.graph import DynamoGraph

from .conftest import WORKLOAD_IMAGE, describe, get, wait_for
from .controlplane import POD_CIDR


def graph_manifest(name: str, namespace: str, services: dict | None = None) -> dict:
    return {
        "apiVersion": "dynamograph.io/v1alpha1",
        "kind": "DynamoGraph",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"name": "Qwen/Qwen3-0.6B", "servedModelName": "qwen"},
            "backend": "mock",
            "services": services
            or {
                "worker": {"componentType": "worker", "replicas": 2, "resources": {"gpu": 1}},
                "epp": {"componentType": "epp", "replicas": 1},
            },
        },
    }


def condition(graph: dict, kind: str) -> dict:
    return next((c for c in graph.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def ready_graph(cp, namespace: str, name: str) -> dict | None:
    g = get(cp, "dg", name, "-n", namespace)
    if not g:
        return None
    status = g.get("status", {})
    if status.get("observedGeneration") != g["metadata"]["generation"]:
        return None
    if status.get("state") == "ready" and condition(g, "Ready").get("status") == "True":
        return g
    return None


def pods_of(cp, namespace: str, selector: str) -> list[dict]:
    return get(cp, "pods", "-n", namespace, "-l", selector)["items"]


def pod_ready(pod: dict) -> bool:
    return pod.get("status", {}).get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in pod.get("status", {}).get("conditions", [])
    )


def test_graph_rolls_out_to_ready_pods_and_status_follows(control_plane, operator, namespace):
    cp = control_plane
    cp.kubectl_apply(graph_manifest("g", namespace))
    show = lambda: describe(cp, namespace, operator)  # noqa: E731

    g = wait_for("graph g Ready", lambda: ready_graph(cp, namespace, "g"), 120, describe=show)
    assert condition(g, "Available")["status"] == "True"
    assert condition(g, "Progressing")["reason"] == "RolloutComplete"
    assert condition(g, "Degraded")["status"] == "False"
    assert g["status"]["services"]["worker"]["readyReplicas"] == 2
    assert g["status"]["services"]["epp"]["readyReplicas"] == 1

    # Deployments owned by the graph; their pods created by the real ReplicaSet controller in a
    # restricted namespace, scheduled onto kwok Nodes, Running and Ready with loopback IPs.
    for svc, replicas in (("worker", 2), ("epp", 1)):
        deploy = get(cp, "deployment", f"g-{svc}", "-n", namespace)
        owner = deploy["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"]) == (
            "DynamoGraph",
            "g",
            g["metadata"]["uid"],
        )
        assert owner.get("controller") is True
        pods = [p for p in pods_of(cp, namespace, f"dynamograph.io/service={svc}") if pod_ready(p)]
        assert len(pods) == replicas, show()
        for pod in pods:
            assert pod["spec"]["nodeName"].startswith("kwok-node-")
            assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(POD_CIDR)
            assert pod["spec"]["containers"][0]["image"] == WORKLOAD_IMAGE

    # Status follows a change: scale the workers; the graph leaves Ready while the new pod is
    # missing, then is Ready again with three.
    cp.kubectl(
        "patch", "dg", "g", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"services": {"worker": {"replicas": 3}}}}),
    )  # fmt: skip
    g = wait_for(
        "graph g Ready with 3 workers",
        lambda: (
            (r := ready_graph(cp, namespace, "g"))
            and r["status"]["services"]["worker"]["readyReplicas"] == 3
            and r
        ),
        120,
        describe=show,
    )
    assert (
        len([p for p in pods_of(cp, namespace, "dynamograph.io/service=worker") if pod_ready(p)])
        == 3
    )
    assert operator.forbidden() == [], "the API refused the operator:\n" + "\n".join(
        operator.forbidden()
    )


def test_deleting_the_graph_garbage_collects_what_it_owns(control_plane, operator, namespace):
    cp = control_plane
    cp.kubectl_apply(graph_manifest("gc", namespace))
    show = lambda: describe(cp, namespace, operator)  # noqa: E731
    wait_for("graph gc Ready", lambda: ready_graph(cp, namespace, "gc"), 120, describe=show)
    owned = {
        "deployment": ["gc-worker", "gc-epp"],
        "service": ["gc-epp", "gc-frontend"],
        "configmap": ["gc-router"],
        "serviceaccount": [discovery_name("gc")],
        "role": [discovery_name("gc")],
        "rolebinding": [discovery_name("gc")],
        "inferencepool": ["gc"],
    }
    for kind, names in owned.items():
        for n in names:
            assert get(cp, kind, n, "-n", namespace) is not None, f"{kind}/{n} missing\n{show()}"
    assert pods_of(cp, namespace, "dynamograph.io/graph=gc")

    cp.kubectl("delete", "dg", "gc", "-n", namespace, "--wait=false")
    # The operator has no deletion handler: the controller-manager's garbage collector removes
    # every dependent (and the ReplicaSets' pods) once the graph is gone.
    for kind, names in owned.items():
        for n in names:
            wait_for(
                f"{kind}/{n} garbage-collected",
                lambda kind=kind, n=n: get(cp, kind, n, "-n", namespace) is None,
                90,
                describe=show,
            )
    wait_for(
        "graph gc's pods gone",
        lambda: pods_of(cp, namespace, "dynamograph.io/graph=gc") == [],
        90,
        describe=show,
    )
    assert get(cp, "dg", "gc", "-n", namespace) is None


INVALID = [
    (
        "prefill without decode",
        {
            "worker": {"componentType": "worker"},
            "prefill": {"componentType": "prefill"},
        },
        "services: a prefill service needs a decode service to hand off to",
    ),
    (
        "two endpoint pickers",
        {
            "worker": {"componentType": "worker"},
            "a": {"componentType": "epp"},
            "b": {"componentType": "epp"},
        },
        "services: at most one epp service per graph",
    ),
    (
        "router on a worker",
        {"worker": {"componentType": "worker", "router": {"mode": "kv"}}},
        "router: only epp and frontend services route",
    ),
    (
        "negative replicas",
        {"worker": {"componentType": "worker", "replicas": -1}},
        "spec.services.worker.replicas: Invalid value: -1: spec.services.worker.replicas in body "
        "should be greater than or equal to 0",
    ),
    (
        "unknown component type",
        {"worker": {"componentType": "gpu-worker"}},
        'spec.services.worker.componentType: Unsupported value: "gpu-worker"',
    ),
]


@pytest.mark.parametrize(("case", "services", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_graph_is_refused_by_the_crd(
    control_plane, chart_release, namespace, case, services, message
):
    cp = control_plane
    res = cp.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps(graph_manifest("bad", namespace, services)),
        check=False,
    )
    assert res.returncode != 0, f"{case}: accepted\n{res.stdout}"
    assert message in res.stderr, res.stderr
    assert get(cp, "dg", "bad", "-n", namespace) is None


def _dry_run_pod(cp, namespace: str, name: str, spec: dict) -> subprocess.CompletedProcess:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }
    return cp.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)


def test_restricted_namespace_admits_every_generated_pod(control_plane, chart_release, namespace):
    """Every pod template the operator generates, for every component type, passes Pod Security
    "restricted" as enforced by the real apiserver (a server-side dry-run create)."""
    cp = control_plane
    body = graph_manifest(
        "psa",
        namespace,
        {
            "decode": {"componentType": "decode", "resources": {"gpu": 1}},
            "prefill": {"componentType": "prefill", "dataParallelSize": 2},
            "epp": {"componentType": "epp", "tls": {"mode": "Secret", "secretName": "epp-cert"}},
            "frontend": {"componentType": "frontend", "router": {"mode": "round-robin"}},
        },
    )
    graph = DynamoGraph.model_validate(body)
    objects = desired_objects(
        graph, Owner(namespace=namespace, name="psa", uid="0"), OperatorConfig(image=WORKLOAD_IMAGE)
    )
    # the pods' ServiceAccount must exist for the ServiceAccount admission plugin
    cp.kubectl("create", "serviceaccount", discovery_name("psa"), "-n", namespace)
    deployments = [o for o in objects if o["kind"] == "Deployment"]
    assert len(deployments) == 4
    for d in deployments:
        res = _dry_run_pod(cp, namespace, d["metadata"]["name"], d["spec"]["template"]["spec"])
        assert res.returncode == 0 and "violate" not in res.stderr, (
            f"{d['metadata']['name']}: {res.stderr}"
        )


def test_restricted_namespace_refuses_a_pod_that_may_escalate(control_plane, namespace):
    """The control for the test above: Pod Security admission is really enforcing."""
    res = _dry_run_pod(
        control_plane,
        namespace,
        "loose",
        {"containers": [{"name": "c", "image": WORKLOAD_IMAGE}]},
    )
    assert res.returncode != 0
    assert 'violates PodSecurity "restricted:latest"' in res.stderr, res.stderr
    assert "allowPrivilegeEscalation != false" in res.stderr


def test_only_pods_that_call_the_api_get_a_service_account_token(
    control_plane, operator, namespace
):
    """The ServiceAccount admission plugin mounts a token into every pod unless told not to:
    prefill pods (an engine only) get none; the decode pods' frontend sidecar and the EPP
    discover pods through the API and keep theirs."""
    cp = control_plane
    services = {
        "decode": {"componentType": "decode"},
        "prefill": {"componentType": "prefill"},
        "epp": {"componentType": "epp"},
    }
    cp.kubectl_apply(graph_manifest("tok", namespace, services))
    show = lambda: describe(cp, namespace, operator)  # noqa: E731
    wait_for("graph tok Ready", lambda: ready_graph(cp, namespace, "tok"), 120, describe=show)

    def token_mounted(pod: dict) -> bool:
        return any(
            "serviceAccountToken" in str(v.get("projected", {}))
            for v in pod["spec"].get("volumes", [])
        )

    for svc, wants_token in (("prefill", False), ("decode", True), ("epp", True)):
        pods = pods_of(cp, namespace, f"dynamograph.io/graph=tok,dynamograph.io/service={svc}")
        assert pods, show()
        for pod in pods:
            assert token_mounted(pod) is wants_token, (svc, pod["spec"].get("volumes"))
