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
        "admission limits on a round-robin frontend",
        {
            "worker": {"componentType": "worker"},
            "fe": {
                "componentType": "frontend",
                "router": {"mode": "round-robin", "maxPendingPicks": 8},
            },
        },
        "a round-robin frontend picks without a queue and admits every request",
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


OPERATOR_USER = "system:serviceaccount:dynamograph-system:dynamograph"

# Granted by the chart but not called in the scenario below, each for a reason. A grant that is
# neither called nor listed here is unneeded: the test names it.
EXPECTED_UNUSED = {
    # Kubernetes lets the operator grant (in each graph's discovery Role) only what it holds.
    ("", "pods", "get"): "held to grant it in g-discovery",
    ("", "pods", "list"): "held to grant it in g-discovery",
    ("", "pods", "watch"): "held to grant it in g-discovery",
    **{
        ("inference.networking.x-k8s.io", "inferenceobjectives", verb): (
            "held to grant it in g-discovery (the EPP's objective watch)"
        )
        for verb in ("get", "list", "watch")
    },
    # kopf's Events go to the core API; events.k8s.io is granted for kopf versions that use it.
    ("events.k8s.io", "events", "create"): "newer kopf posts through events.k8s.io",
    # kopf watches namespaces only when given namespace patterns (-n), not with -A. (Listing
    # them is called: every pass lists its graph's namespace, by name, to see it being deleted.)
    ("", "namespaces", "watch"): "kopf with --namespace patterns",
    # Always wanted while the graph exists; the garbage collector removes them with it. The
    # reconciler's generic "delete what is no longer wanted" could, were they ever dropped.
    ("", "serviceaccounts", "delete"): "generic prune; never dropped today",
    ("rbac.authorization.k8s.io", "roles", "delete"): "generic prune; never dropped today",
    ("rbac.authorization.k8s.io", "rolebindings", "delete"): "generic prune; never dropped today",
    ("", "services", "delete"): "the frontend Service is never dropped while workers exist",
    # single reads: the operator lists by label; kopf gets the graph only in some paths
    ("dynamograph.io", "dynamographs", "get"): "kopf reads single graphs on some paths",
    ("dynamograph.io", "dynamographs/status", "get"): "not read; granted with patch",
    # A single object is read only after its create answered 409 (adopt it or report a
    # NameConflict): the scenario provokes that for the ConfigMap alone.
    **{
        (group, res, "get"): "read after a 409 on create"
        for group, res in (
            ("", "serviceaccounts"),
            ("", "services"),
            ("apps", "deployments"),
            ("rbac.authorization.k8s.io", "roles"),
            ("rbac.authorization.k8s.io", "rolebindings"),
            ("inference.networking.k8s.io", "inferencepools"),
            ("gateway.networking.k8s.io", "httproutes"),
            ("networking.k8s.io", "networkpolicies"),
            ("policy", "poddisruptionbudgets"),
        )
    },
    # Only listed here (the CRD is not installed): test_production_manifests.py installs it
    # and checks these calls.
    **{
        ("monitoring.coreos.com", "podmonitors", verb): "no monitoring CRD in this scenario"
        for verb in ("get", "create", "patch", "delete")
    },
}


def granted_rules(cp) -> set[tuple[str, str, str]]:
    out = set()
    for role in ("dynamograph", "dynamograph-discovery", "dynamograph-crd"):
        for rule in get(cp, "clusterrole", role)["rules"]:
            # only the CRD role names an object: the operator's own CRD, which it applies
            names = ["dynamographs.dynamograph.io"] if role == "dynamograph-crd" else None
            assert rule.get("resourceNames") == names, rule
            for group in rule.get("apiGroups", []):
                for res in rule.get("resources", []):
                    for verb in rule["verbs"]:
                        out.add((group, res, verb))
    return out


def operator_calls(cp) -> tuple[set[tuple[str, str, str]], list[str]]:
    """(apiGroup, resource[/subresource], verb) of every request the operator made, and the
    ones RBAC refused, as text."""
    used, refused = set(), []
    for e in cp.audit_events(OPERATOR_USER):
        ref = e.get("objectRef") or {}
        if not ref.get("resource"):
            continue  # discovery (/api, /apis) and other non-resource URLs
        res = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        key = (ref.get("apiGroup", ""), res, e["verb"])
        # RBAC's own verdict (a 403 can also be admission's, e.g. a terminating namespace)
        if (e.get("annotations") or {}).get("authorization.k8s.io/decision") == "forbid":
            refused.append(f"{key} {e.get('requestURI')}")
        else:
            used.add(key)
    return used, refused


def test_operator_rbac_is_exactly_what_it_calls(control_plane, operator, namespace):
    """Through the apiserver's audit log: every call of the operator's ServiceAccount is granted
    (a missing verb fails here), and every grant of the chart is called or explained."""
    cp = control_plane
    show = lambda: describe(cp, namespace, operator)  # noqa: E731
    services = {
        "worker": {"componentType": "worker"},
        "epp": {"componentType": "epp"},
    }
    body = graph_manifest("rb", namespace, services)
    body["spec"]["gateway"] = {"parentRef": {"name": "inference-gateway"}}
    # Somebody else's ConfigMap under the name the graph wants: a NameConflict (the operator
    # reads it after its create answers 409, and posts a Warning Event), healed once it goes.
    cp.kubectl("create", "configmap", "rb-router", "-n", namespace)
    cp.kubectl_apply(body)
    wait_for(
        "graph rb Degraded by a NameConflict",
        lambda: (
            condition(get(cp, "dg", "rb", "-n", namespace), "Degraded").get("reason")
            == "NameConflict"
        ),
        60,
        describe=show,
    )
    assert any(
        ev["reason"] == "NameConflict" or "rb-router" in ev.get("message", "")
        for ev in get(cp, "events", "-n", namespace)["items"]
        if ev["involvedObject"]["kind"] == "DynamoGraph" and ev["type"] == "Warning"
    ), show()
    cp.kubectl("delete", "configmap", "rb-router", "-n", namespace)
    wait_for("graph rb Ready", lambda: ready_graph(cp, namespace, "rb"), 120, describe=show)

    # Drift on every owned kind: the operator patches each back.
    owned = [
        ("deployment", "rb-worker"),
        ("service", "rb-frontend"),
        ("configmap", "rb-router"),
        ("serviceaccount", "rb-discovery"),
        ("role", "rb-discovery"),
        ("rolebinding", "rb-discovery"),
        ("inferencepool", "rb"),
        ("httproute", "rb"),
        ("networkpolicy", "rb-engines"),
        ("poddisruptionbudget", "rb-epp"),
    ]
    for kind, name in owned:
        cp.kubectl("label", kind, name, "-n", namespace, "--overwrite", "app.kubernetes.io/name=x")
    for kind, name in owned:
        wait_for(
            f"{kind}/{name} repaired",
            lambda kind=kind, name=name: (
                get(cp, kind, name, "-n", namespace)["metadata"]["labels"]["app.kubernetes.io/name"]
                == "dynamograph"
            ),
            60,
            describe=show,
        )
    # Dropping the EPP and the gateway: the operator deletes what only they needed.
    cp.kubectl(
        "patch", "dg", "rb", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"gateway": None, "services": {"epp": None}}}),
    )  # fmt: skip
    for kind, name in (("deployment", "rb-epp"), ("configmap", "rb-router"), ("httproute", "rb")):
        wait_for(
            f"{kind}/{name} deleted by the operator",
            lambda kind=kind, name=name: get(cp, kind, name, "-n", namespace) is None,
            60,
            describe=show,
        )

    used, refused = operator_calls(cp)
    assert refused == [], "the apiserver refused the operator:\n" + "\n".join(refused)
    granted = granted_rules(cp)
    assert used <= granted, f"called without a grant: {sorted(used - granted)}"
    unused = granted - used
    unexplained = sorted(unused - set(EXPECTED_UNUSED))
    assert unexplained == [], f"granted by the chart but never called: {unexplained}"

    # The control: a call outside the grants is refused and seen as refused by this check.
    kubectl = cp.kubectl_argv()[0]
    res = subprocess.run(
        [kubectl, f"--kubeconfig={operator.kubeconfig}", "get", "secrets", "-n", namespace],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0 and "Forbidden" in res.stderr, res.stderr
    _, refused = wait_for(
        "the refused call in the audit log",
        lambda: (calls := operator_calls(cp))[1] and calls,
        30,
    )
    assert [r.split(" ")[0:3] for r in refused] == [["('',", "'secrets',", "'list')"]], refused
