"""status.endpoint against a real control plane: the Gateway API CRDs served by the apiserver, a
Gateway created as a gateway admin would, its `status.addresses` written through the status
subresource as its controller would, and the graph's `status.endpoint` and `kubectl get dg`'s
ENDPOINT column following it. The operator runs with the chart's ServiceAccount token, so a
verb the chart does not grant on gateways fails here.

The Gateway CRD comes from tests/operator/data/upstream-crds (an unmodified copy of Gateway API
v1.6.1's standard channel), which the session fixture installs with the others.
"""

import json
import uuid

from .conftest import UPSTREAM_CRDS, describe, get, wait_for
from .test_operator import condition, graph_manifest

GATEWAY_CRD = UPSTREAM_CRDS / "gateway.networking.k8s.io_gateways.yaml"


def gateway_manifest(namespace: str, listeners: list[dict], name: str = "inference-gateway"):
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"gatewayClassName": "example", "listeners": listeners},
    }


def write_addresses(cp, namespace: str, *values: str, name: str = "inference-gateway") -> None:
    """What the gateway's controller does once its proxies are reachable (only it may write
    Gateway status: through the status subresource)."""
    status = {"addresses": [{"type": "IPAddress", "value": v} for v in values]}
    cp.kubectl(
        "patch", "gateway", name, "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip


def endpoint_is(cp, namespace: str, graph: str, reason: str, endpoint: str | None):
    def check():
        g = get(cp, "dg", graph, "-n", namespace) or {}
        status = g.get("status") or {}
        cond = condition(g, "EndpointAssigned")
        if cond.get("reason") == reason and status.get("endpoint") == endpoint:
            return g
        return None

    return check


def printed_endpoint(cp, namespace: str, graph: str) -> str:
    """The ENDPOINT column of `kubectl get dg` (the CRD's printer column; kubectl aligns the
    columns and leaves an unset one blank)."""
    header, row = cp.kubectl("get", "dg", graph, "-n", namespace).stdout.splitlines()
    assert " ENDPOINT " in header, header
    start = header.index(" ENDPOINT ") + 1
    end = header.index(" AGE", start) + 1
    return row[start:end].strip()


def attached_graph(name: str, namespace: str, gateway: dict) -> dict:
    body = graph_manifest(
        name,
        namespace,
        {"worker": {"componentType": "worker"}, "epp": {"componentType": "epp"}},
    )
    body["spec"]["gateway"] = gateway
    return body


def test_gateway_crd_is_served(control_plane):
    cp = control_plane
    crd = get(cp, "crd", "gateways.gateway.networking.k8s.io")
    assert crd is not None, f"{GATEWAY_CRD} was not installed by the session fixture"
    assert crd["metadata"]["annotations"]["gateway.networking.k8s.io/bundle-version"] == "v1.6.1"


def test_status_endpoint_follows_the_gateway(control_plane, operator, namespace):
    cp = control_plane
    show = lambda: describe(cp, namespace, operator)  # noqa: E731
    cp.kubectl_apply(attached_graph("ep", namespace, {"parentRef": {"name": "inference-gateway"}}))
    g = wait_for(
        "EndpointAssigned=False GatewayNotFound",
        endpoint_is(cp, namespace, "ep", "GatewayNotFound", None),
        60,
        describe=show,
    )
    assert condition(g, "EndpointAssigned")["message"] == (
        f"Gateway {namespace}/inference-gateway does not exist"
    )
    assert printed_endpoint(cp, namespace, "ep") == ""

    # The gateway admin creates the Gateway; no controller has given it an address yet.
    listeners = [{"name": "http", "protocol": "HTTP", "port": 8080}]
    cp.kubectl_apply(gateway_manifest(namespace, listeners))
    g = wait_for(
        "EndpointAssigned=False GatewayAddressPending",
        endpoint_is(cp, namespace, "ep", "GatewayAddressPending", None),
        60,
        describe=show,
    )
    assert condition(g, "EndpointAssigned")["status"] == "False"
    assert printed_endpoint(cp, namespace, "ep") == ""

    # Its controller writes the address: the endpoint is the Gateway's, on the listener's port.
    write_addresses(cp, namespace, "203.0.113.7")
    wait_for(
        "status.endpoint = the Gateway's address",
        endpoint_is(cp, namespace, "ep", "GatewayAddress", "http://203.0.113.7:8080"),
        60,
        describe=show,
    )
    assert printed_endpoint(cp, namespace, "ep") == "http://203.0.113.7:8080"

    # A hostname on the route: the URL names it (requests must carry it).
    patch = {"spec": {"gateway": {"hostnames": ["chat.example.com"]}}}
    cp.kubectl("patch", "dg", "ep", "-n", namespace, "--type=merge", "-p", json.dumps(patch))
    g = wait_for(
        "status.endpoint with the route's hostname",
        endpoint_is(cp, namespace, "ep", "GatewayAddress", "http://chat.example.com:8080"),
        60,
        describe=show,
    )
    assert (
        "curl --resolve chat.example.com:8080:203.0.113.7"
        in (condition(g, "EndpointAssigned")["message"])
    )
    assert printed_endpoint(cp, namespace, "ep") == "http://chat.example.com:8080"

    cp.kubectl("delete", "gateway", "inference-gateway", "-n", namespace)
    wait_for(
        "no endpoint once the Gateway is gone",
        endpoint_is(cp, namespace, "ep", "GatewayNotFound", None),
        60,
        describe=show,
    )
    assert operator.forbidden() == [], "the API refused the operator:\n" + "\n".join(
        operator.forbidden()
    )


def test_a_gateway_in_another_namespace(control_plane, operator, namespace):
    """The common layout: one shared Gateway in an infrastructure namespace, whose listener
    admits routes from every namespace; read with the chart's cluster-wide grant."""
    cp = control_plane
    infra = f"infra-{uuid.uuid4().hex[:8]}"
    cp.kubectl("create", "namespace", infra)
    show = lambda: describe(cp, namespace, operator)  # noqa: E731
    try:
        listeners = [
            {"name": "local", "protocol": "HTTP", "port": 80},  # routes from `infra` only
            {
                "name": "shared",
                "protocol": "HTTP",
                "port": 8000,
                "allowedRoutes": {"namespaces": {"from": "All"}},
            },
        ]
        cp.kubectl_apply(gateway_manifest(infra, listeners, name="shared"))
        write_addresses(cp, infra, "198.51.100.4", name="shared")
        ref = {"name": "shared", "namespace": infra}
        cp.kubectl_apply(attached_graph("far", namespace, {"parentRef": ref}))
        g = wait_for(
            "status.endpoint on the listener that admits the graph's namespace",
            endpoint_is(cp, namespace, "far", "GatewayAddress", "http://198.51.100.4:8000"),
            60,
            describe=show,
        )
        assert condition(g, "EndpointAssigned")["message"] == (
            f"http://198.51.100.4:8000: the address of Gateway {infra}/shared, listener shared "
            "(HTTP 8000)"
        )
        assert printed_endpoint(cp, namespace, "far") == "http://198.51.100.4:8000"
    finally:
        cp.kubectl("delete", "namespace", infra, "--wait=false", check=False)
    assert operator.forbidden() == [], "\n".join(operator.forbidden())
