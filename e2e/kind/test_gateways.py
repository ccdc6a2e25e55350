"""The gateway checks on a real kind cluster, once per gateway: kgateway, and Envoy Gateway with
Envoy AI Gateway (installed from their published charts at the versions kindctl pins;
`E2E_GATEWAYS` picks). For each, a graph whose HTTPRoute attaches to that gateway's Gateway:

- requests reach the worker the endpoint picker chose, with its routing headers: the workers'
  sidecars serve in direct mode, which refuses a request without them, and count each one;
  routing headers a client forges do not move a request off the worker the picker chose;
- `status.endpoint` is the Gateway's own address (written by the gateway controller from its
  load balancer, cloud-provider-kind's here), `kubectl get dg` prints it, and a chat completion
  sent there from a pod in the cluster is answered;
- a streamed completion of ~40 s, past Envoy's default 15 s route timeout, arrives whole, on a
  second graph whose route matches its own hostname (`gateway.hostnames`): its endpoint names
  that hostname;
- with the EPP scaled to 0, FailClose: the gateway answers 503 within seconds, and requests
  flow again once it is back.

Where Docker (or kind, kubectl, helm) is missing, every test skips naming what is missing.
"""

import asyncio
import json
import time
import uuid

import aiohttp
import pytest

from dynamograph.protocol.headers import DESTINATION_ENDPOINT, WORKER_INSTANCE_ID
from dynamograph.protocol.identity import instance_id

from ..graphs import (
    load_example,
    renamed,
    with_engine,
    with_gateway,
    with_image,
    with_replicas,
    without_gpus,
)
from ..traffic import affinity_breaks, chat_body, failures, parse_reply, prompt_families
from ..waiting import wait_for_sync
from . import kindctl
from .conftest import port_forwarded
from .kindctl import run, run_json
from .test_kind import (
    MODEL,
    SPEEDUP,
    _families,
    deployed,
    frontend_direct_ok,
    graph_pods,
    pod_ids,
    wait_epp_knows,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

# One decode step of the mock engine takes ~6.3 ms at speedup 1 (tests/epp/
# test_generated_route.py); at 0.1 ~63 ms, so 600 tokens stream for ~40 s.
SLOW_SPEEDUP = 0.1
SLOW_TOKENS = 600


@pytest.fixture(scope="module", params=list(kindctl.GATEWAYS))
def profile(request, kind_cluster) -> kindctl.GatewayProfile:
    if request.param not in kind_cluster.gateways:
        pytest.skip(f"{request.param} is not selected (E2E_GATEWAYS={kind_cluster.gateways})")
    return kindctl.GATEWAYS[request.param]


@pytest.fixture(scope="module")
def proxy_url(kind_cluster, profile):
    with port_forwarded(kind_cluster, profile) as url:
        yield url


def graph_for(s: kindctl.Settings, profile: kindctl.GatewayProfile, name: str, **engine):
    graph = renamed(load_example("agg"), name, s.namespace)
    graph = with_replicas(without_gpus(with_image(graph, s.image)), "worker", 2)
    return with_gateway(with_engine(graph, **engine), profile.gateway)


@pytest.fixture(scope="module")
def graph(kind_cluster, profile, proxy_url):
    """The aggregated example (2 workers) attached to the profile's Gateway, serving."""
    s = kind_cluster
    with deployed(s, graph_for(s, profile, f"agg-{profile.name}", speedup=SPEEDUP)) as name:
        wait_epp_knows(s, name, {"aggregated": 2})
        wait_serving(proxy_url)
        yield name


# ---- requests ---------------------------------------------------------------------------------


async def _chat(url: str, body: dict, headers: dict[str, str] | None = None):
    async with aiohttp.ClientSession() as http:
        started = time.monotonic()
        async with http.post(
            f"{url}/v1/chat/completions",
            json=body,
            headers=headers or {},
            timeout=aiohttp.ClientTimeout(total=60),
        ) as response:
            reply = parse_reply(response.status, await response.read())
        return reply, time.monotonic() - started


def chat_once(url: str, prompt: str = "ping", headers: dict[str, str] | None = None):
    return asyncio.run(_chat(url, chat_body(MODEL, prompt), headers))


def wait_serving(url: str, host: str | None = None) -> None:
    """The gateway programs a new HTTPRoute asynchronously: poll until a request succeeds."""
    headers = {"host": host} if host else None
    wait_for_sync(
        lambda: chat_once(url, headers=headers)[0].status == 200,
        f"the gateway to route to the graph{f' (host {host})' if host else ''}",
        within=300,
        interval=3,
    )


async def _stream_tokens(url: str, host: str) -> tuple[int, float]:
    """Tokens a streamed completion delivered before its stream ended (cleanly or not), and
    how long it ran."""
    body = {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": SLOW_TOKENS}
    received, started = 0, time.monotonic()
    async with aiohttp.ClientSession() as http:
        try:
            async with http.post(
                f"{url}/v1/completions",
                json={**body, "stream": True},
                headers={"host": host},
                timeout=aiohttp.ClientTimeout(total=600),
            ) as response:
                assert response.status == 200, await response.text()
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        received += len(json.loads(line[6:])["choices"][0]["text"]) > 0
        except aiohttp.ClientPayloadError:
            pass  # cut: what arrived until then counts
    return received, time.monotonic() - started


def from_the_cluster(s: kindctl.Settings, url: str, host: str | None = None) -> dict:
    """A chat completion sent from a pod in the cluster (the probe), as a client there would."""
    pod = f"probe-{uuid.uuid4().hex[:8]}"
    return kindctl.probe_result(run(kindctl.probe(s, pod, url, MODEL, host), timeout=300).stdout)


# ---- status.endpoint --------------------------------------------------------------------------


def gateway_of(s: kindctl.Settings, profile: kindctl.GatewayProfile) -> dict:
    return run_json(kindctl.get_json(s, "gateway", s.namespace, profile.gateway))


def endpoint_condition(graph: dict) -> dict:
    conditions = (graph.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "EndpointAssigned"), {})


def wait_endpoint(s: kindctl.Settings, name: str, expected: str) -> dict:
    def reported():
        g = run_json(kindctl.get_json(s, "dynamograph", s.namespace, name))
        return g if (g.get("status") or {}).get("endpoint") == expected else None

    return wait_for_sync(reported, f"status.endpoint {expected}", within=180, interval=3)


def printed_endpoint(s: kindctl.Settings, name: str) -> str:
    table = run(kindctl.kubectl(s, "get", "dynamograph", name, "-n", s.namespace)).stdout
    (value,) = kindctl.printed_column(table, "ENDPOINT")
    return value


# ---- the checks -------------------------------------------------------------------------------


def test_requests_reach_the_picked_worker_with_its_routing_headers(
    kind_cluster, profile, proxy_url, graph
):
    s = kind_cluster
    pods = graph_pods(s, graph, "worker")
    ids = pod_ids(pods)
    before = frontend_direct_ok(s, pods)
    replies = asyncio.run(_families(proxy_url, seed=23))
    flat = [r for family in replies for r in family]
    assert not failures(flat), failures(flat)
    assert {r.decode_worker for r in flat} <= ids
    assert not affinity_breaks(replies, lambda r: r.decode_worker)
    # Every request was served by a sidecar in direct mode: it carried the picker's headers.
    assert frontend_direct_ok(s, pods) - before == len(flat)

    # A client naming another worker (routing header, destination header) is not obeyed: the
    # first family's first prompt again goes to the worker that cached its prefix.
    first = prompt_families(4, variants=3, seed=23)[0].prompts()[0]
    chosen = replies[0][0].decode_worker
    other = next(p for p in pods if instance_id(p["metadata"]["name"]) != chosen)
    forged = {
        WORKER_INSTANCE_ID: str(instance_id(other["metadata"]["name"])),
        DESTINATION_ENDPOINT: f"{other['status']['podIP']}:8080",
    }
    reply, _ = chat_once(proxy_url, first, headers=forged)
    assert reply.status == 200, reply.text
    assert reply.decode_worker == chosen, (reply.decode_worker, chosen)


def test_status_endpoint_is_the_gateways_address_and_answers(kind_cluster, profile, graph):
    s = kind_cluster
    address = wait_for_sync(
        lambda: kindctl.gateway_address(gateway_of(s, profile)),
        f"an address in Gateway {profile.gateway}'s status",
        within=300,
        interval=3,
    )
    expected = kindctl.http_url(address)  # the listener's port is 80
    g = wait_endpoint(s, graph, expected)
    condition = endpoint_condition(g)
    assert (condition["status"], condition["reason"]) == ("True", "GatewayAddress"), condition
    assert printed_endpoint(s, graph) == expected

    answer = from_the_cluster(s, expected)
    assert answer["status"] == 200, answer
    reply = parse_reply(200, answer["body"].encode())
    assert reply.decode_worker in pod_ids(graph_pods(s, graph, "worker")), answer


def test_a_long_stream_is_not_cut(kind_cluster, profile, proxy_url, graph):
    s = kind_cluster
    host = f"slow-{profile.name}.e2e.example"
    slow = graph_for(s, profile, f"slow-{profile.name}", speedup=SLOW_SPEEDUP)
    slow = with_replicas(slow, "worker", 1)
    slow["spec"]["gateway"]["hostnames"] = [host]
    with deployed(s, slow) as name:
        wait_epp_knows(s, name, {"aggregated": 1})
        wait_serving(proxy_url, host)
        tokens, seconds = asyncio.run(_stream_tokens(proxy_url, host))
        assert tokens == SLOW_TOKENS, (tokens, seconds)
        assert seconds > 20, seconds  # past Envoy's default route timeout of 15 s

        # Its route matches only its hostname: the endpoint names it, the message the address.
        address = kindctl.gateway_address(gateway_of(s, profile))
        g = wait_endpoint(s, name, kindctl.http_url(host))
        assert f"resolve to {address}" in endpoint_condition(g)["message"]
        answer = from_the_cluster(s, kindctl.http_url(address), host)
        assert answer["status"] == 200, answer


def test_fail_close_answers_503_with_the_epp_scaled_to_zero(
    kind_cluster, profile, proxy_url, graph
):
    s = kind_cluster
    scale = {"spec": {"services": {"epp": {"replicas": 0}}}}
    run(kindctl.merge_patch(s, "dynamograph", s.namespace, graph, scale))
    try:
        wait_for_sync(
            lambda: not run_json(
                kindctl.get_json(
                    s, "pods", s.namespace, "-l",
                    f"dynamograph.io/graph={graph},dynamograph.io/service=epp",
                )
            )["items"],
            "the EPP's pods gone",
            within=300,
            interval=3,
        )  # fmt: skip
        wait_for_sync(
            lambda: chat_once(proxy_url)[0].status == 503,
            "the gateway to answer 503 (FailClose)",
            within=120,
            interval=2,
        )
        for _ in range(5):
            reply, seconds = chat_once(proxy_url)
            assert reply.status == 503, reply.text
            assert seconds < 10, seconds  # at once, not after a timeout
    finally:
        scale["spec"]["services"]["epp"]["replicas"] = 1
        run(kindctl.merge_patch(s, "dynamograph", s.namespace, graph, scale))
    wait_epp_knows(s, graph, {"aggregated": 2})
    wait_serving(proxy_url)
