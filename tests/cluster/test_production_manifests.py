"""The production objects of a graph on a real control plane (chart installed by helm, the
operator with the chart's ServiceAccount token, a namespace enforcing Pod Security
"restricted"): the apiserver accepts the NetworkPolicies, PodDisruptionBudgets and the
admin-token Secret, the disruption controller finds the budgets' pods, garbage collection
removes everything with the graph, a PodMonitor appears only once the Prometheus Operator's CRD
is installed (tests/operator/data/prometheus-operator/, a minimal copy of its CRD), and the
chart's RBAC covers every call. kwok runs no network plugin: that NetworkPolicy is enforced is
the CNI's job and is not shown here, only that the cluster takes the policies as written."""

import base64

from .conftest import describe, get, wait_for
from .controlplane import REPO
from .test_operator import graph_manifest, operator_calls, pods_of, ready_graph

PODMONITOR_CRD = (
    REPO / "tests/operator/data/prometheus-operator/monitoring.coreos.com_podmonitors.yaml"
)
PODMONITOR_CRD_NAME = "podmonitors.monitoring.coreos.com"
SERVICES = {
    "decode": {"componentType": "decode", "replicas": 2},
    "prefill": {"componentType": "prefill"},
    "epp": {"componentType": "epp"},
}


def owned_by_graph(obj: dict, graph: dict) -> bool:
    return any(
        ref["uid"] == graph["metadata"]["uid"] and ref.get("controller")
        for ref in obj["metadata"].get("ownerReferences", [])
    )


def test_production_objects_are_accepted_collected_and_monitored_once_the_crd_exists(
    control_plane, operator, namespace
):
    cp = control_plane
    show = lambda: describe(cp, namespace, operator)  # noqa: E731
    assert get(cp, "crd", PODMONITOR_CRD_NAME) is None, "another test left the CRD installed"
    # (the audit log is the session's: test_operator.py's control call is refused on purpose)
    refused_before = set(operator_calls(cp)[1])
    cp.kubectl_apply(graph_manifest("prod", namespace, SERVICES))
    graph = wait_for(
        "graph prod Ready", lambda: ready_graph(cp, namespace, "prod"), 120, describe=show
    )

    owned = {
        "networkpolicy": ["prod-engines", "prod-epp"],
        "poddisruptionbudget": ["prod-epp", "prod-decode"],
        "secret": ["prod-admin-token"],
    }
    for kind, names in owned.items():
        for name in names:
            obj = get(cp, kind, name, "-n", namespace)
            assert obj is not None and owned_by_graph(obj, graph), f"{kind}/{name}\n{show()}"
    # The disruption controller (the real controller-manager) finds each budget's pods.
    for name, pods in (("prod-decode", 2), ("prod-epp", 1)):
        wait_for(
            f"PDB {name} covering {pods} pods",
            lambda name=name, pods=pods: (
                get(cp, "pdb", name, "-n", namespace).get("status", {}).get("expectedPods") == pods
            ),
            60,
            describe=show,
        )
    # The engines read the token from the Secret; it is in no pod spec and not in the log.
    token = base64.b64decode(
        get(cp, "secret", "prod-admin-token", "-n", namespace)["data"]["token"]
    ).decode()
    assert len(token) >= 40
    engine_pods = pods_of(cp, namespace, "dynamograph.io/graph=prod,dynamograph.io/service=prefill")
    assert engine_pods, show()
    env = {e["name"]: e for e in engine_pods[0]["spec"]["containers"][0]["env"]}
    assert env["DYNAMOGRAPH_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "prod-admin-token"
    assert token not in operator.log_tail(10**7)

    # No monitoring CRD: no PodMonitor, and the graph is Ready (checked above), not Degraded.
    assert cp.kubectl("get", "podmonitors", "-n", namespace, check=False).returncode != 0
    try:
        cp.kubectl("apply", "--server-side", "-f", str(PODMONITOR_CRD))
        cp.kubectl(
            "wait", "--for=condition=Established", "--timeout=60s", f"crd/{PODMONITOR_CRD_NAME}"
        )
        monitor = wait_for(
            "PodMonitor prod",
            lambda: get(cp, "podmonitor", "prod", "-n", namespace),
            60,
            describe=show,
        )
        assert owned_by_graph(monitor, graph)
        assert monitor["spec"]["selector"]["matchLabels"]["dynamograph.io/graph"] == "prod"
        assert ready_graph(cp, namespace, "prod"), show()
        owned["podmonitor"] = ["prod"]

        cp.kubectl("delete", "dg", "prod", "-n", namespace, "--wait=false")
        for kind, names in owned.items():
            for name in names:
                wait_for(
                    f"{kind}/{name} garbage-collected",
                    lambda kind=kind, name=name: get(cp, kind, name, "-n", namespace) is None,
                    90,
                    describe=show,
                )
    finally:
        cp.kubectl("delete", "crd", PODMONITOR_CRD_NAME, "--ignore-not-found", check=False)

    used, refused = operator_calls(cp)
    refused = [r for r in refused if r not in refused_before]
    assert refused == [], "the apiserver refused the operator:\n" + "\n".join(refused)
    for call in (
        ("", "secrets", "create"),
        ("networking.k8s.io", "networkpolicies", "create"),
        ("policy", "poddisruptionbudgets", "create"),
        ("monitoring.coreos.com", "podmonitors", "list"),
        ("monitoring.coreos.com", "podmonitors", "create"),
    ):
        assert call in used, call
    # The operator never reads a Secret (it holds no right to).
    assert not [c for c in used if c[1] == "secrets" and c[2] != "create"], used


def test_an_admin_token_secret_made_beforehand_is_used_as_it_is(control_plane, operator, namespace):
    cp = control_plane
    show = lambda: describe(cp, namespace, operator)  # noqa: E731
    cp.kubectl(
        "create", "secret", "generic", "mine-admin-token", "-n", namespace,
        "--from-literal=token=chosen-by-the-platform",
    )  # fmt: skip
    cp.kubectl_apply(graph_manifest("mine", namespace, SERVICES))
    wait_for("graph mine Ready", lambda: ready_graph(cp, namespace, "mine"), 120, describe=show)
    secret = get(cp, "secret", "mine-admin-token", "-n", namespace)
    assert base64.b64decode(secret["data"]["token"]) == b"chosen-by-the-platform"
    assert not secret["metadata"].get("ownerReferences")  # theirs: it outlives the graph
    graph = get(cp, "dg", "mine", "-n", namespace)
    conditions = {c["type"]: c for c in graph["status"]["conditions"]}
    assert conditions["Degraded"]["status"] == "False", show()
