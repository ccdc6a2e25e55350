"""The DynamoGraph's /scale subresource against the real control plane: `kubectl scale dg/NAME`
sets spec.replicas, the operator scales the scale target's Deployment, kwok runs the pods, and
status.scale (what /scale reads back) follows; the selector is the target's pods. A graph whose
target is ambiguous refuses the scale (CEL). examples/hpa.yaml is accepted by the apiserver and
the real HorizontalPodAutoscaler controller reads the graph's /scale."""

import json

import yaml

from .conftest import describe, get, wait_for
from .controlplane import REPO
from .test_operator import graph_manifest, pod_ready, pods_of, ready_graph

SELECTOR = "dynamograph.io/graph=sc,dynamograph.io/service=worker"


def scale_of(cp, namespace: str, name: str) -> dict:
    return cp.get_json("dg", name, "-n", namespace, "--subresource=scale")


def test_kubectl_scale_scales_the_worker_deployment(control_plane, operator, namespace):
    cp = control_plane
    show = lambda: describe(cp, namespace, operator)  # noqa: E731
    cp.kubectl_apply(
        graph_manifest(
            "sc",
            namespace,
            {
                "worker": {"componentType": "worker", "replicas": 1},
                "epp": {"componentType": "epp"},
            },
        )
    )
    g = wait_for("graph sc Ready", lambda: ready_graph(cp, namespace, "sc"), 120, describe=show)
    assert g["status"]["scale"] == {"service": "worker", "replicas": 1, "selector": SELECTOR}
    # Without spec.replicas the apiserver cannot read /scale (docs/operator.md: set it for an
    # HPA); `kubectl scale` patches it in regardless.
    res = cp.kubectl("get", "dg", "sc", "-n", namespace, "--subresource=scale", check=False)
    assert res.returncode != 0 and '".spec.replicas" does not exist' in res.stderr, res.stderr

    res = cp.kubectl("scale", "dg/sc", "-n", namespace, "--replicas", "3", check=False)
    assert res.returncode == 0, res.stderr
    scale = scale_of(cp, namespace, "sc")
    assert scale["kind"] == "Scale" and scale["spec"] == {"replicas": 3}
    assert scale["status"]["selector"] == SELECTOR
    assert get(cp, "dg", "sc", "-n", namespace)["spec"]["replicas"] == 3
    wait_for(
        "3 running worker pods",
        lambda: len([p for p in pods_of(cp, namespace, SELECTOR) if pod_ready(p)]) == 3,
        120,
        describe=show,
    )
    assert get(cp, "deployment", "sc-worker", "-n", namespace)["spec"]["replicas"] == 3
    g = wait_for(
        "status.scale.replicas 3",
        lambda: (
            (r := ready_graph(cp, namespace, "sc")) and r["status"]["scale"]["replicas"] == 3 and r
        ),
        120,
        describe=show,
    )
    assert g["status"]["services"]["worker"]["readyReplicas"] == 3
    assert g["status"]["services"]["epp"]["replicas"] == 1  # other services keep their count
    assert scale_of(cp, namespace, "sc")["spec"]["replicas"] == 3
    assert scale_of(cp, namespace, "sc")["status"] == {"replicas": 3, "selector": SELECTOR}
    assert operator.forbidden() == [], "\n".join(operator.forbidden())


def test_scaling_a_graph_with_an_ambiguous_target_is_refused(
    control_plane, chart_release, namespace
):
    cp = control_plane
    cp.kubectl_apply(
        graph_manifest(
            "two",
            namespace,
            {"a": {"componentType": "worker"}, "b": {"componentType": "worker"}},
        )
    )
    res = cp.kubectl("scale", "dg/two", "-n", namespace, "--replicas", "2", check=False)
    assert res.returncode != 0
    assert "replicas: the graph has several worker/decode services" in res.stderr, res.stderr
    # naming the target makes it scalable
    cp.kubectl("patch", "dg", "two", "-n", namespace, "--type=merge",
               "-p", json.dumps({"spec": {"scaleTarget": "b"}}))  # fmt: skip
    res = cp.kubectl("scale", "dg/two", "-n", namespace, "--replicas", "2", check=False)
    assert res.returncode == 0, res.stderr


def test_the_hpa_example_targets_the_scale_subresource(control_plane, operator, namespace):
    """The HPA controller (kube-controller-manager) gets the graph's /scale (AbleToScale,
    SucceededGetScale). No metrics adapter runs here, so it says it cannot read the metric
    (ScalingActive False): what prometheus-adapter provides (docs/operator.md)."""
    cp = control_plane
    show = lambda: describe(cp, namespace, operator)  # noqa: E731
    body = graph_manifest(
        "llama70b",
        namespace,
        {"worker": {"componentType": "worker"}, "epp": {"componentType": "epp"}},
    )
    body["spec"]["replicas"] = 2
    cp.kubectl_apply(body)
    wait_for("graph Ready", lambda: ready_graph(cp, namespace, "llama70b"), 120, describe=show)
    hpa = yaml.safe_load((REPO / "examples" / "hpa.yaml").read_text())
    hpa["metadata"]["namespace"] = namespace
    res = cp.kubectl("apply", "-f", "-", input=json.dumps(hpa), check=False)
    assert res.returncode == 0, res.stderr

    def conditions() -> dict | None:
        status = get(cp, "hpa", "llama70b", "-n", namespace).get("status") or {}
        by_type = {c["type"]: c for c in status.get("conditions") or []}
        return by_type if "ScalingActive" in by_type else None

    by_type = wait_for("the HPA's conditions", conditions, 120, describe=show)
    assert by_type["AbleToScale"]["status"] == "True", by_type
    assert by_type["AbleToScale"]["reason"] == "SucceededGetScale", by_type
    assert by_type["ScalingActive"]["status"] == "False", by_type
    assert by_type["ScalingActive"]["reason"] == "FailedGetPodsMetric", by_type
    assert "dynamograph_worker_waiting_requests" in by_type["ScalingActive"]["message"]
    hpa_status = get(cp, "hpa", "llama70b", "-n", namespace)["status"]
    assert hpa_status["currentReplicas"] == 2  # read from the graph's /scale
