"""status.endpoint and its EndpointAssigned condition: observed Gateway (or frontend) -> URL.

Pure logic (operator/status.py `endpoint_verdict`), the graph's index by Gateway
(handlers.py `gateway_of`), how a pass reads the Gateway (controller.py), and that what is
written fits the CRD and shows in `kubectl get dg`.
"""

import asyncio

import pytest

from dynamograph.operator import crds
from dynamograph.operator.controller import _observe_endpoint
from dynamograph.operator.handlers import gateway_of
from dynamograph.operator.kube import ApiError
from dynamograph.operator.manifests import Owner
from dynamograph.operator.status import (
    ENDPOINT_ASSIGNED,
    EndpointObservation,
    ServiceObservation,
    endpoint_verdict,
    graph_status,
    route_hostnames,
    status_body,
)
from dynamograph.protocol.graph import load_graph

from .schemas import validate_against_crd

pytestmark = pytest.mark.unit

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"
FRONTEND = "http://g-frontend.ns.svc:8080"
PARENT = {"name": "inference-gateway", "group": "gateway.networking.k8s.io", "kind": "Gateway"}
HTTP = {"name": "http", "protocol": "HTTP", "port": 80}


def gateway(*listeners, addresses=(), conditions=(), namespace="ns"):
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "metadata": {"name": "inference-gateway", "namespace": namespace},
        "spec": {"gatewayClassName": "example", "listeners": list(listeners or [HTTP])},
        "status": {"addresses": list(addresses), "conditions": list(conditions)},
    }


def ip(value, kind="IPAddress"):
    return {"type": kind, "value": value} if kind else {"value": value}


def through(gw, parent=PARENT, hostnames=(), namespace="ns", error=None):
    return EndpointObservation(
        namespace,
        FRONTEND,
        parent=parent,
        hostnames=tuple(hostnames),
        gateway=gw,
        error=error,
    )


def verdict(obs):
    url, v = endpoint_verdict(obs)
    return url, v.status, v.reason, v.message


# -- without a gateway ----------------------------------------------------------------------------


def test_a_standalone_frontend_is_the_endpoint_in_the_cluster():
    url, status, reason, message = verdict(EndpointObservation("ns", FRONTEND, True))
    assert (url, status, reason) == (FRONTEND, "True", "FrontendService")
    assert "pick a worker for every request" in message


def test_direct_mode_sidecars_alone_are_no_endpoint():
    """What the issue found: the frontend Service of a graph without a standalone frontend
    reaches only the workers' direct-mode sidecars, which answer a plain curl with 400."""
    url, status, reason, message = verdict(EndpointObservation("ns", FRONTEND, False))
    assert (url, status, reason) == (None, "False", "NoRoutingFrontend")
    assert "Worker ID required" in message
    assert "gateway.parentRef" in message and "componentType: frontend" in message


# -- through a Gateway ----------------------------------------------------------------------------


def test_the_gateways_address_is_the_endpoint():
    url, status, reason, message = verdict(through(gateway(addresses=[ip("203.0.113.7")])))
    assert (url, status, reason) == ("http://203.0.113.7", "True", "GatewayAddress")
    assert message == (
        "http://203.0.113.7: the address of Gateway ns/inference-gateway, listener http (HTTP 80)"
    )


def test_until_the_gateway_has_an_address_there_is_no_url():
    programmed = {
        "type": "Programmed",
        "status": "False",
        "reason": "AddressNotAssigned",
        "message": "No addresses have been assigned to the Gateway",
    }
    url, status, reason, message = verdict(through(gateway(conditions=[programmed])))
    assert (url, status, reason) == (None, "False", "GatewayAddressPending")
    assert message == (
        "Gateway ns/inference-gateway has no address yet (its status.addresses is empty); its "
        "Programmed condition is False (AddressNotAssigned): No addresses have been assigned "
        "to the Gateway"
    )
    # A Gateway nobody has written status for yet
    bare = gateway()
    del bare["status"]
    assert verdict(through(bare))[:3] == (None, "False", "GatewayAddressPending")


def test_listener_port_and_scheme():
    https = {"name": "https", "protocol": "HTTPS", "port": 443}
    cases = [
        ({"name": "web", "protocol": "HTTP", "port": 8080}, "http://203.0.113.7:8080"),
        (https, "https://203.0.113.7"),
        ({**https, "port": 8443}, "https://203.0.113.7:8443"),
    ]
    for listener, expected in cases:
        gw = gateway(listener, addresses=[ip("203.0.113.7")])
        assert verdict(through(gw))[0] == expected, listener


def test_addresses_a_url_can_be_made_of():
    ipv6 = gateway(addresses=[ip("2001:db8::7")])
    assert verdict(through(ipv6))[0] == "http://[2001:db8::7]"
    named = gateway(addresses=[ip("lb.example.net", "Hostname")])
    assert verdict(through(named))[0] == "http://lb.example.net"
    untyped = gateway(addresses=[ip("198.51.100.1", kind=None)])  # type defaults to IPAddress
    assert verdict(through(untyped))[0] == "http://198.51.100.1"
    # Implementation-specific address types say nothing a URL can use: the next address counts.
    mixed = gateway(addresses=[ip("pool-a", "example.net/named"), ip("198.51.100.2")])
    assert verdict(through(mixed))[0] == "http://198.51.100.2"
    assert verdict(through(gateway(addresses=[ip("x", "NamedAddress")])))[2] == (
        "GatewayAddressPending"
    )


def test_the_listener_the_route_attaches_to():
    tcp = {"name": "tcp", "protocol": "TCP", "port": 9000}
    web = {"name": "web", "protocol": "HTTP", "port": 8080}
    gw = gateway(tcp, HTTP, web, addresses=[ip("203.0.113.7")])
    # The first HTTP(S) listener; a sectionName picks its own.
    assert verdict(through(gw))[0] == "http://203.0.113.7"
    assert verdict(through(gw, parent={**PARENT, "sectionName": "web"}))[0] == (
        "http://203.0.113.7:8080"
    )
    url, status, reason, message = verdict(through(gw, parent={**PARENT, "sectionName": "nope"}))
    assert (url, status, reason) == (None, "False", "ListenerNotFound")
    assert message == "Gateway ns/inference-gateway has no listener named 'nope'"
    url, _, reason, message = verdict(through(gw, parent={**PARENT, "sectionName": "tcp"}))
    assert (url, reason) == (None, "NoMatchingListener")
    assert "listeners: tcp (TCP 9000)" in message


def test_allowed_routes_decide_the_listener():
    same = {**HTTP, "name": "same"}  # allowedRoutes default: routes from the Gateway's namespace
    everyone = {"name": "all", "protocol": "HTTP", "port": 8000}
    everyone["allowedRoutes"] = {"namespaces": {"from": "All"}}
    gw = gateway(same, everyone, addresses=[ip("203.0.113.7")], namespace="infra")
    parent = {**PARENT, "namespace": "infra"}
    # A graph in ns: only the listener that admits routes from every namespace
    assert verdict(through(gw, parent=parent))[0] == "http://203.0.113.7:8000"
    # A graph in the Gateway's own namespace: the first listener
    assert verdict(through(gw, parent=parent, namespace="infra"))[0] == "http://203.0.113.7"
    grpc_only = {**everyone, "allowedRoutes": {"kinds": [{"kind": "GRPCRoute"}]}}
    url, _, reason, message = verdict(through(gateway(same, grpc_only, namespace="infra"), parent))
    assert (url, reason) == (None, "NoMatchingListener")
    assert message.startswith(
        "Gateway infra/inference-gateway has no HTTP or HTTPS listener the graph's HTTPRoute "
        "can attach to (hostnames any, namespace ns; listeners: same (HTTP 80), all (HTTP 8000))"
    )
    selector = {**HTTP, "allowedRoutes": {"namespaces": {"from": "Selector"}}}
    gw = gateway(selector, addresses=[ip("203.0.113.7")], namespace="infra")
    assert verdict(through(gw, parent=parent))[0] == "http://203.0.113.7"  # judged by the gateway


def test_a_hostname_the_route_matches_is_the_urls_host():
    gw = gateway(addresses=[ip("203.0.113.7")])
    url, status, reason, message = verdict(through(gw, hostnames=["chat.example.com"]))
    assert (url, status, reason) == ("http://chat.example.com", "True", "GatewayAddress")
    assert message == (
        "http://chat.example.com: Gateway ns/inference-gateway, listener http (HTTP 80) at "
        "203.0.113.7; the route matches host chat.example.com, which must resolve to "
        "203.0.113.7 (or: curl --resolve chat.example.com:80:203.0.113.7 "
        "http://chat.example.com/v1/models)"
    )
    # The first name that is not a wildcard
    assert verdict(through(gw, hostnames=["*.example.com", "api.example.com"]))[0] == (
        "http://api.example.com"
    )
    # A listener's own hostname applies when the route names none
    named = gateway({**HTTP, "hostname": "llm.example.com"}, addresses=[ip("203.0.113.7")])
    assert verdict(through(named))[0] == "http://llm.example.com"


def test_wildcards_alone_make_no_url():
    gw = gateway(addresses=[ip("203.0.113.7")])
    url, status, reason, message = verdict(through(gw, hostnames=["*.example.com"]))
    assert (url, status, reason) == (None, "False", "WildcardHostname")
    assert "['*.example.com']" in message and "set gateway.hostnames" in message


def test_route_and_listener_hostnames_intersect():
    assert route_hostnames(None, ()) == []
    assert route_hostnames("a.example.com", ()) == ["a.example.com"]
    assert route_hostnames(None, ("a.example.com",)) == ["a.example.com"]
    assert route_hostnames("*.example.com", ("a.example.com", "b.other.com")) == ["a.example.com"]
    assert route_hostnames("a.example.com", ("*.example.com",)) == ["a.example.com"]
    assert route_hostnames("*.example.com", ("x.y.example.com",)) == ["x.y.example.com"]
    assert route_hostnames("*.example.com", ("example.com",)) is None
    assert route_hostnames("a.example.com", ("b.example.com",)) is None
    # A listener the route's hostnames do not reach is skipped
    listeners = [{**HTTP, "hostname": "other.net"}, {"name": "b", "protocol": "HTTP", "port": 81}]
    gw = gateway(*listeners, addresses=[ip("203.0.113.7")])
    assert verdict(through(gw, hostnames=["chat.example.com"]))[0] == "http://chat.example.com:81"


def test_no_gateway_to_read():
    url, status, reason, message = verdict(through(None))
    assert (url, status, reason) == (None, "False", "GatewayNotFound")
    assert message == "Gateway ns/inference-gateway does not exist"
    forbidden = "403 Forbidden: gateways.gateway.networking.k8s.io is forbidden"
    url, status, reason, message = verdict(through(None, error=forbidden))
    assert (url, status, reason) == (None, "Unknown", "GatewayUnreadable")
    assert message == f"Gateway ns/inference-gateway: cannot read it: {forbidden}"
    other = {"name": "mesh", "group": "", "kind": "Service"}
    url, status, reason, _ = verdict(through(None, parent=other))
    assert (url, status, reason) == (None, "Unknown", "NotAGateway")
    # The parentRef's namespace, else the graph's
    elsewhere = verdict(through(None, parent={**PARENT, "namespace": "infra"}))
    assert elsewhere[3] == "Gateway infra/inference-gateway does not exist"


# -- in the graph's status ------------------------------------------------------------------------


def status_of(endpoint, previous=None, now=T0):
    return status_body(
        graph_status(
            {"worker": ServiceObservation(1, None)},
            [],
            generation=2,
            previous=previous,
            endpoint=endpoint,
            now=now,
        )
    )


def condition(status, kind=ENDPOINT_ASSIGNED):
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_status_carries_the_url_and_the_condition():
    pending = status_of(through(gateway()))
    assert "endpoint" not in pending
    assert condition(pending)["reason"] == "GatewayAddressPending"
    # Once the gateway controller writes an address, the URL appears; the time moves.
    ready = status_of(through(gateway(addresses=[ip("203.0.113.7")])), previous=pending, now=T1)
    assert ready["endpoint"] == "http://203.0.113.7"
    assert condition(ready) | {"message": ""} == {
        "type": ENDPOINT_ASSIGNED,
        "status": "True",
        "reason": "GatewayAddress",
        "message": "",
        "lastTransitionTime": T1,
        "observedGeneration": 2,
    }
    # It gates nothing: state and the other conditions are what they are without it.
    plain = status_of("http://203.0.113.7")
    assert pending["state"] == plain["state"]
    others = [c for c in pending["conditions"] if c["type"] != ENDPOINT_ASSIGNED]
    assert others == plain["conditions"]


def test_an_invalid_spec_keeps_the_last_endpoint():
    before = status_of(through(gateway(addresses=[ip("203.0.113.7")])))
    kept = status_of(None, previous=before, now=T1)
    assert kept["endpoint"] == "http://203.0.113.7"
    assert condition(kept) == condition(before)  # same reason, message and transition time
    assert "endpoint" not in status_of(None)
    assert all(c["type"] != ENDPOINT_ASSIGNED for c in status_of(None)["conditions"])


def test_what_the_operator_writes_fits_the_crd():
    crd = crds.build_crd()
    body = load_graph_body()
    for endpoint in (through(gateway()), through(gateway(addresses=[ip("203.0.113.7")]))):
        validate_against_crd({**body, "status": status_of(endpoint)}, crd)
    (version,) = crd["spec"]["versions"]
    columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["State", "Ready", "Replicas", "Backend", "Endpoint", "Age"]
    (endpoint,) = [c for c in version["additionalPrinterColumns"] if c["name"] == "Endpoint"]
    assert endpoint["jsonPath"] == ".status.endpoint"


def load_graph_body():
    return {
        "apiVersion": "dynamograph.io/v1alpha1",
        "kind": "DynamoGraph",
        "metadata": {"name": "g", "namespace": "ns"},
        "spec": {
            "model": {"name": "m"},
            "services": {"worker": {"componentType": "worker"}, "epp": {"componentType": "epp"}},
            "gateway": {"parentRef": {"name": "inference-gateway"}},
        },
    }


# -- the index of graphs by Gateway, and the pass's read ------------------------------------------


def test_graphs_are_indexed_by_their_gateway():
    body = load_graph_body()
    assert gateway_of(body) == ("ns", "inference-gateway")
    body["spec"]["gateway"]["parentRef"]["namespace"] = "infra"
    assert gateway_of(body) == ("infra", "inference-gateway")
    body["spec"]["gateway"]["parentRef"]["kind"] = "Service"
    assert gateway_of(body) is None
    body["spec"]["gateway"] = {}
    assert gateway_of(body) is None
    assert gateway_of({"metadata": {"namespace": "ns"}, "spec": {}}) is None


class FakeApi:
    def __init__(self, answer):
        self.answer, self.calls = answer, []

    async def get(self, api_version, kind, namespace, name):
        self.calls.append((api_version, kind, namespace, name))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def observe(api, body):
    graph = load_graph(body)
    return asyncio.run(_observe_endpoint(api, graph, Owner("g", "ns", "uid")))


def test_a_pass_reads_the_gateway_of_its_parent_ref():
    body = load_graph_body()
    body["spec"]["gateway"]["parentRef"]["namespace"] = "infra"
    body["spec"]["gateway"]["hostnames"] = ["chat.example.com"]
    api = FakeApi(gateway(addresses=[ip("203.0.113.7")], namespace="infra"))
    obs = observe(api, body)
    assert api.calls == [("gateway.networking.k8s.io/v1", "Gateway", "infra", "inference-gateway")]
    assert (obs.namespace, obs.frontend_url, obs.hostnames) == (
        "ns",
        FRONTEND,
        ("chat.example.com",),
    )
    assert obs.parent["name"] == "inference-gateway" and obs.error is None
    # A refused read is the condition's, not the pass's failure
    refused = observe(FakeApi(ApiError(403, "Forbidden", "cannot get gateways")), body)
    assert endpoint_verdict(refused)[1].reason == "GatewayUnreadable"
    assert refused.error == "403 Forbidden: cannot get gateways"


def test_a_pass_without_a_gateway_reads_nothing():
    body = load_graph_body()
    del body["spec"]["gateway"]
    del body["spec"]["services"]["epp"]
    api = FakeApi(None)
    assert observe(api, body) == EndpointObservation("ns", FRONTEND, False)
    body["spec"]["services"]["front"] = {"componentType": "frontend"}
    assert observe(api, body).frontend_routes is True
    assert api.calls == []
