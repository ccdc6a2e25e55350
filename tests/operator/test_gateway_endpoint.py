"""status.endpoint follows the Gateway's address, through the operator's watch on Gateways.

The real operator against the API emulator (as test_operator.py): the test plays the gateway
admin (creates and deletes the Gateway) and the gateway controller (writes its
`status.addresses`). The timer is 10 minutes away, so every change has to come through the
Gateway watch and the index of graphs by Gateway. tests/cluster/test_gateway_status.py does the
same against a real control plane with the chart's RBAC.
"""

import pytest

from e2e.waiting import wait_for

from .emulator import NAMESPACE, upstream_crd
from .schemas import validate_against_crd
from .test_operator import (
    condition,
    create_graph,
    disagg_graph,
    graph_status,
    running_operator,
    wait_ready,
)

pytestmark = [
    pytest.mark.operator,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),
]

GATEWAYS = f"/apis/gateway.networking.k8s.io/v1/namespaces/{NAMESPACE}/gateways"


def gateway_body() -> dict:
    body = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "metadata": {"name": "inference-gateway", "namespace": NAMESPACE},
        "spec": {
            "gatewayClassName": "example",
            "listeners": [{"name": "http", "protocol": "HTTP", "port": 8080}],
        },
    }
    validate_against_crd(body, upstream_crd("Gateway"))
    return body


def endpoint_is(cluster, reason: str, endpoint: str | None):
    def check():
        status = graph_status(cluster)
        cond = condition(status, "EndpointAssigned")
        return (
            status if cond.get("reason") == reason and status.get("endpoint") == endpoint else None
        )

    return check


async def write_addresses(cluster, *values: str) -> None:
    """What a gateway controller does once its proxies' Service has an address."""
    addresses = [{"type": "IPAddress", "value": v} for v in values]
    response = await cluster.patch(
        f"{GATEWAYS}/inference-gateway/status",
        json={"status": {"addresses": addresses}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert response.status == 200, await response.text()


async def test_status_endpoint_follows_the_gateways_address(cluster):
    with running_operator():
        await create_graph(cluster, disagg_graph())
        status = await wait_ready(cluster)
        assert condition(status, "EndpointAssigned")["reason"] == "GatewayNotFound"

        # The gateway admin creates the Gateway; its controller has not given it an address.
        response = await cluster.post(GATEWAYS, json=gateway_body())
        assert response.status in (200, 201), await response.text()
        status = await wait_for(
            endpoint_is(cluster, "GatewayAddressPending", None), "GatewayAddressPending", within=20
        )
        assert condition(status, "EndpointAssigned")["status"] == "False"
        assert status["state"] == "ready"  # it gates nothing

        await write_addresses(cluster, "203.0.113.7")
        await wait_for(
            endpoint_is(cluster, "GatewayAddress", "http://203.0.113.7:8080"),
            "status.endpoint = the Gateway's address",
            within=20,
        )
        await write_addresses(cluster, "203.0.113.9")
        await wait_for(
            endpoint_is(cluster, "GatewayAddress", "http://203.0.113.9:8080"),
            "status.endpoint = the Gateway's new address",
            within=20,
        )

        response = await cluster.delete(f"{GATEWAYS}/inference-gateway")
        assert response.status == 200, await response.text()
        await wait_for(
            endpoint_is(cluster, "GatewayNotFound", None), "no endpoint once it is gone", within=20
        )
