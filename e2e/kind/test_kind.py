"""The e2e scenarios on a real kind cluster: Helm-installed operator, kgateway, real pods.

Same scenarios as `e2e/local` (which runs them in CI without Docker): aggregated and
disaggregated requests succeed through the gateway, prefix affinity holds, the routing headers
reach the frontend sidecars, scaling a service changes the InferencePool's endpoints and the new
pod takes traffic, and deleting the graph removes everything it owned.
"""

import asyncio
import contextlib

import aiohttp
import pytest

from dynamograph.protocol.identity import instance_id

from ..graphs import (
    Manifest,
    load_example,
    renamed,
    with_engine,
    with_gateway,
    with_image,
    without_gpus,
)
from ..traffic import (
    affinity_breaks,
    chat,
    chat_body,
    epp_ready_workers,
    failures,
    metric_sum,
    prompt_families,
    run_families,
    send_until,
)
from ..waiting import wait_for_sync
from . import kindctl
from .kindctl import Settings, run, run_json

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

MODEL = "qwen"
SPEEDUP = 20.0


def manifest_for(s: Settings, example: str) -> Manifest:
    graph = renamed(load_example(example), example, s.namespace)
    graph = with_engine(without_gpus(with_image(graph, s.image)), speedup=SPEEDUP)
    return with_gateway(graph, kindctl.GATEWAY_NAME)


def graph_pods(s: Settings, graph: str, service: str | None = None) -> list[dict]:
    selector = f"dynamograph.io/graph={graph}"
    if service:
        selector += f",dynamograph.io/service={service}"
    return kindctl.ready_pods(run_json(kindctl.get_json(s, "pods", s.namespace, "-l", selector)))


def pod_ids(pods: list[dict]) -> set[int]:
    return {instance_id(p["metadata"]["name"]) for p in pods}


def pool_endpoints(s: Settings, graph: str) -> list[dict]:
    """Ready pods the graph's InferencePool selects (what the gateway may route to)."""
    pool = run_json(kindctl.get_json(s, "inferencepool", s.namespace, graph))
    labels = pool["spec"]["selector"]["matchLabels"]
    selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return kindctl.ready_pods(run_json(kindctl.get_json(s, "pods", s.namespace, "-l", selector)))


def pod_metrics(s: Settings, pod: dict, port: int) -> str:
    """A pod's /metrics through the API server's pod proxy (no port-forward per pod)."""
    path = f"/api/v1/namespaces/{s.namespace}/pods/{pod['metadata']['name']}:{port}/proxy/metrics"
    return run(kindctl.kubectl(s, "get", "--raw", path)).stdout


def wait_epp_knows(s: Settings, graph: str, expected: dict[str, int]) -> None:
    def known():
        (epp,) = graph_pods(s, graph, "epp")
        return epp_ready_workers(pod_metrics(s, epp, 9090)) == expected

    wait_for_sync(known, f"the EPP to know {expected}", within=120, interval=2)


def frontend_direct_ok(s: Settings, pods: list[dict]) -> float:
    """Requests the pods' frontend sidecars served in direct mode, via the API server proxy."""
    total = 0.0
    for pod in pods:
        path = f"/api/v1/namespaces/{s.namespace}/pods/{pod['metadata']['name']}:8080/proxy/metrics"
        text = run(kindctl.kubectl(s, "get", "--raw", path)).stdout
        total += metric_sum(
            text, "dynamograph_frontend_requests_total", mode="direct", outcome="ok"
        )
    return total


@contextlib.contextmanager
def deployed(s: Settings, graph: Manifest):
    name = graph["metadata"]["name"]
    kindctl.apply_objects(s, [graph])
    try:
        run(
            kindctl.kubectl(
                s, "wait", f"dynamograph/{name}", "-n", s.namespace,
                "--for=jsonpath={.status.state}=ready", "--timeout=600s",
            ),
            timeout=660,
        )  # fmt: skip
        yield name
    finally:
        run(kindctl.delete(s, "dynamograph", s.namespace, name), timeout=300)


def _exactly(n: int, ids: set[int]) -> set[int] | None:
    return ids if len(ids) == n else None


def decode_ready(s: Settings, graph: str) -> int:
    status = run_json(kindctl.get_json(s, "dynamograph", s.namespace, graph)).get("status") or {}
    return int(((status.get("services") or {}).get("decode") or {}).get("readyReplicas", 0))


def assert_cleaned_up(s: Settings, name: str) -> None:
    def gone():
        listing = run_json(
            kindctl.get_json(
                s, "deployments,services,configmaps,inferencepools,httproutes,pods",
                s.namespace, "-l", f"dynamograph.io/graph={name}",
            )
        )  # fmt: skip
        return not kindctl.items(listing)

    wait_for_sync(gone, f"every object of graph {name} deleted", within=300, interval=3)


async def _serving(url: str) -> bool:
    async with aiohttp.ClientSession() as http:
        reply = await chat(http, url, chat_body(MODEL, "ping"), request_timeout=20)
        return reply.status == 200


def wait_routable(url: str) -> None:
    """The gateway programs the new HTTPRoute asynchronously: poll until a request succeeds."""
    wait_for_sync(
        lambda: asyncio.run(_serving(url)),
        "the gateway to route to the graph",
        within=300,
        interval=3,
    )


async def _families(url: str, seed: int):
    async with aiohttp.ClientSession() as http:
        return await run_families(http, url, MODEL, prompt_families(4, variants=3, seed=seed))


async def _until(url: str, done):
    async with aiohttp.ClientSession() as http:
        return await send_until(http, url, MODEL, done)


def test_aggregated_graph_through_the_gateway(kind_cluster, gateway_url):
    s = kind_cluster
    graph = manifest_for(s, "agg")
    with deployed(s, graph) as name:
        pods = graph_pods(s, name, "worker")
        assert len(pods) == graph["spec"]["services"]["worker"]["replicas"]
        wait_epp_knows(s, name, {"aggregated": len(pods)})
        wait_routable(gateway_url)
        before = frontend_direct_ok(s, pods)
        replies = asyncio.run(_families(gateway_url, seed=7))
        flat = [r for f in replies for r in f]
        assert not failures(flat), failures(flat)
        assert {r.decode_worker for r in flat} <= pod_ids(pods)
        assert not affinity_breaks(replies, lambda r: r.decode_worker)
        assert frontend_direct_ok(s, pods) - before == len(flat)
    assert_cleaned_up(s, name)


def test_disaggregated_graph_scales_and_cleans_up(kind_cluster, gateway_url):
    s = kind_cluster
    graph = manifest_for(s, "disagg")
    with deployed(s, graph) as name:
        prefills = pod_ids(graph_pods(s, name, "prefill"))
        decodes = pod_ids(graph_pods(s, name, "decode"))
        assert pod_ids(pool_endpoints(s, name)) == decodes
        wait_epp_knows(s, name, {"prefill": len(prefills), "decode": len(decodes)})
        wait_routable(gateway_url)
        replies = asyncio.run(_families(gateway_url, seed=11))
        flat = [r for f in replies for r in f]
        assert not failures(flat), failures(flat)
        assert all(r.prefill_worker in prefills for r in flat)
        assert {r.decode_worker for r in flat} <= decodes
        assert not affinity_breaks(replies, lambda r: r.prefill_worker)

        patch = {"spec": {"services": {"decode": {"replicas": 3}}}}
        run(kindctl.merge_patch(s, "dynamograph", s.namespace, name, patch))
        grown = wait_for_sync(
            lambda: _exactly(3, pod_ids(pool_endpoints(s, name))),
            "the InferencePool to select 3 ready decode pods",
            within=600,
            interval=3,
        )
        (new,) = grown - decodes
        wait_epp_knows(s, name, {"prefill": len(prefills), "decode": 3})
        more = asyncio.run(_until(gateway_url, lambda r: r.decode_worker == new))
        assert not failures(more), failures(more)
        assert new in {r.decode_worker for r in more}
        wait_for_sync(
            lambda: decode_ready(s, name) == 3,
            "the graph's status to report 3 ready decode replicas",
            within=120,
            interval=3,
        )
    assert_cleaned_up(s, name)
