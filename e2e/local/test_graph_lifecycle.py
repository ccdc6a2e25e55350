"""The cluster-in-a-box end to end: DynamoGraph -> kopf operator -> pods -> EPP -> real Envoy.

Per graph: apply it, wait for the operator to report it ready (its Deployments' pods run as
loopback processes under the process kubelet), send requests through Envoy, where the EPP
(discovering the pods by its Kubernetes watch) picks workers by KV overlap; scale a service
and see the new pod take traffic; delete the graph and see every process gone.

The same scenarios run on a real cluster in `e2e/kind`. One more turns on what the pods get
from Secret volumes: the EPP's TLS certificate from a Secret the user made, and CURVE keys for
the KV-event stream from the Secret the operator makes.
"""

import asyncio
import base64
import ssl

import aiohttp
import pytest
import pytest_asyncio
import zmq
import zmq.asyncio
from cryptography.hazmat.primitives import serialization

from dynamograph.epp.tls import self_signed_pair
from dynamograph.local.procs import is_live
from dynamograph.protocol.identity import instance_id
from dynamograph.protocol.kv_curve import CurveKeys
from dynamograph.protocol.kv_events import END_SEQ, encode_seq

from ..graphs import load_example, renamed, with_engine, with_replicas, without_gpus
from ..traffic import (
    affinity_breaks,
    chat_body,
    chat_stream,
    epp_ready_workers,
    failures,
    metric_sum,
    prompt_families,
    run_families,
    scrape,
    send_until,
)
from ..waiting import wait_for
from . import pods as podlib
from .cluster import local_cluster
from .conftest import ENVOY_MISSING, requires_loopback_range
from .gateway import run_gateway
from .kubeapi import DEPLOYMENTS, INFERENCEPOOLS, PODS, SECRETS

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(420),
    pytest.mark.skipif(ENVOY_MISSING is not None, reason=f"needs Envoy: {ENVOY_MISSING}"),
]

MODEL = "qwen"
SPEEDUP = 100.0  # simulated GPU time runs 100x faster: requests take milliseconds
READY_S = 180.0  # generous: a loaded 2-core box starts a dozen Python processes


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory):
    requires_loopback_range()
    workdir = tmp_path_factory.mktemp("cluster-in-a-box")
    async with local_cluster(workdir) as c:
        yield c


def graph_manifest(example: str, namespace: str, **replicas: int) -> dict:
    manifest = renamed(load_example(example), example, namespace)
    manifest = with_engine(without_gpus(manifest), speedup=SPEEDUP)
    for service, count in replicas.items():
        manifest = with_replicas(manifest, service, count)
    return manifest


def is_ready(pod: dict) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


async def service_pods(cluster, namespace: str, graph: str, service: str) -> list[dict]:
    labels = {"dynamograph.io/graph": graph, "dynamograph.io/service": service}
    return [p for p in await cluster.pods(namespace, labels) if is_ready(p)]


async def ids_of(cluster, namespace: str, graph: str, service: str) -> set[int]:
    return {
        instance_id(p["metadata"]["name"])
        for p in await service_pods(cluster, namespace, graph, service)
    }


async def direct_requests_served(http, pods: list[dict]) -> float:
    """Requests the pods' frontend sidecars served in direct mode (routing headers present)."""
    total = 0.0
    for pod in pods:
        text = await scrape(http, f"http://{pod['status']['podIP']}:8080/metrics")
        total += metric_sum(
            text, "dynamograph_frontend_requests_total", mode="direct", outcome="ok"
        )
    return total


async def wait_epp_knows(cluster, http, namespace: str, graph: str, expected: dict[str, int]):
    """Until the EPP's own gauge shows exactly `expected` ready workers per role: its pod watch
    and /v1/engine fetches have caught up with the pods."""

    async def known():
        (epp,) = await service_pods(cluster, namespace, graph, "epp")
        text = await scrape(http, f"http://{epp['status']['podIP']}:9090/metrics")
        return epp_ready_workers(text) == expected

    await wait_for(known, f"the EPP to know {expected}", within=60, detail=cluster.describe)


async def delete_and_wait_gone(cluster, namespace: str, graph: str) -> None:
    pids = {
        pid
        for pod in cluster.kubelet.pods.values()
        if pod.namespace == namespace
        for pid in pod.pids()
    }
    assert pids, "the graph's pods had no processes to begin with"
    await cluster.delete_graph(namespace, graph)

    async def gone():
        left = (
            await cluster.api.list(PODS, namespace),
            await cluster.api.list(DEPLOYMENTS, namespace),
            await cluster.api.list(INFERENCEPOOLS, namespace),
            await cluster.get_graph(namespace, graph),
        )
        return not any(left) and not any(
            p.namespace == namespace for p in cluster.kubelet.pods.values()
        )

    # Takes seconds; 30 s is slack for a loaded box, yet short of kopf's 60 s re-check of a
    # timer caught mid-pass (the stall `TIMER_STOP_POLL_SECONDS` in operator/handlers.py ends).
    await wait_for(
        gone, f"graph {graph} and everything it owns deleted", within=30, detail=cluster.describe
    )
    still = [pid for pid in pids if is_live(pid)]
    assert not still, f"processes of deleted pods still running: {still}"


async def test_aggregated_graph_routes_by_kv_overlap(cluster, tmp_path):
    ns, name = "e2e-agg", "agg"
    await cluster.apply_graph(graph_manifest("agg", ns, worker=3))
    graph = await cluster.wait_graph_state(ns, name, "ready", READY_S)
    assert graph["status"]["services"]["worker"]["readyReplicas"] == 3

    workers = await ids_of(cluster, ns, name, "worker")
    assert len(workers) == 3
    async with (
        run_gateway(cluster.api, ns, name, tmp_path / "envoy") as envoy,
        aiohttp.ClientSession() as http,
    ):
        await wait_epp_knows(cluster, http, ns, name, {"aggregated": 3})
        replies = await run_families(http, envoy.url, MODEL, prompt_families(4, variants=3))
        flat = [r for family in replies for r in family]
        assert not failures(flat), failures(flat)
        # Every request was served by one of the graph's workers, named by the frontend.
        assert {r.decode_worker for r in flat} <= workers
        # KV overlap: prompts sharing a prefix follow the worker that cached it.
        assert not affinity_breaks(replies, lambda r: r.decode_worker)
        # The routing headers reached the sidecars: they served every request in direct mode.
        pods = await service_pods(cluster, ns, name, "worker")
        assert await direct_requests_served(http, pods) == len(flat)
        # Streaming passes through Envoy, the EPP and the sidecar as server-sent events.
        status, events = await chat_stream(http, envoy.url, chat_body(MODEL, "stream please"))
        assert status == 200 and len(events) > 2 and events[-1] == b"[DONE]", events[-3:]

    await delete_and_wait_gone(cluster, ns, name)


async def test_disaggregated_graph_scales_and_cleans_up(cluster, tmp_path):
    ns, name = "e2e-disagg", "disagg"
    await cluster.apply_graph(graph_manifest("disagg", ns, prefill=2, decode=2))
    await cluster.wait_graph_state(ns, name, "ready", READY_S)
    prefills = await ids_of(cluster, ns, name, "prefill")
    decodes = await ids_of(cluster, ns, name, "decode")
    assert len(prefills) == 2 and len(decodes) == 2

    async with (
        run_gateway(cluster.api, ns, name, tmp_path / "envoy") as envoy,
        aiohttp.ClientSession() as http,
    ):
        await wait_epp_knows(cluster, http, ns, name, {"prefill": 2, "decode": 2})
        replies = await run_families(
            http, envoy.url, MODEL, prompt_families(4, variants=3, seed=11)
        )
        flat = [r for family in replies for r in family]
        assert not failures(flat), failures(flat)
        assert all(r.prefill_worker in prefills for r in flat), "every request had a prefill leg"
        assert {r.decode_worker for r in flat} <= decodes
        # KV overlap decides the prefill worker (the decode pick ignores the prompt's cache).
        assert not affinity_breaks(replies, lambda r: r.prefill_worker)

        # Scale decode 2 -> 3: the operator updates the Deployment, the kubelet starts a pod,
        # the EPP's pod watch adds it, and it takes traffic.
        await cluster.patch_graph(ns, name, {"spec": {"services": {"decode": {"replicas": 3}}}})

        async def three_decodes():
            ids = await ids_of(cluster, ns, name, "decode")
            return ids if len(ids) == 3 else None

        grown = await wait_for(
            three_decodes, "3 ready decode pods", within=READY_S, detail=cluster.describe
        )
        (new,) = grown - decodes
        # The pool as the EPP sees it changed: 3 decode workers now.
        await wait_epp_knows(cluster, http, ns, name, {"prefill": 2, "decode": 3})
        more = await send_until(http, envoy.url, MODEL, lambda r: r.decode_worker == new)
        assert not failures(more), failures(more)
        assert new in {r.decode_worker for r in more}, (
            f"the new decode pod never received traffic in {len(more)} requests: "
            f"{sorted({r.decode_worker for r in more})}"
        )
        status = await cluster.wait_graph_state(ns, name, "ready", 60)
        assert status["status"]["services"]["decode"]["readyReplicas"] == 3

    await delete_and_wait_gone(cluster, ns, name)


async def served_certificate(ip: str, port: int) -> bytes:
    """The DER certificate a TLS connection to ip:port is shown (no verification: just look)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    _, writer = await asyncio.open_connection(ip, port, ssl=context)
    try:
        return writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.transport.abort()  # the server's HTTP/2 preface is unread: no TLS goodbye


async def replayed_batches(endpoint: str, keys: CurveKeys) -> int:
    """How many KV-event batches a worker's replay socket hands a CURVE client holding `keys`
    (from the first on). A worker whose socket is not a CURVE server with the same keys
    completes no handshake, and this times out."""
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        keys.subscribe(dealer)
        dealer.connect(endpoint)
        await dealer.send_multipart([b"", encode_seq(0)])
        count = 0
        while True:
            if not await dealer.poll(30_000):
                raise AssertionError(f"no end of replay from {endpoint} after {count} batches")
            parts = await dealer.recv_multipart()
            if parts[-2] == END_SEQ:
                return count
            count += 1
    finally:
        dealer.close(linger=0)
        context.term()


async def test_secured_graph_serves_tls_from_a_secret_and_kv_events_over_curve(cluster, tmp_path):
    ns, name = "e2e-secure", "secure"
    # The EPP's certificate, as `kubectl create secret tls` stores it (base64 `data`); the
    # operator expects the user to make it, and makes the CURVE Secret itself.
    pair = self_signed_pair((f"{name}-epp.{ns}.svc",))
    tls_data = {"tls.crt": pair.certificate_chain, "tls.key": pair.private_key}
    await cluster.api.create(
        SECRETS,
        ns,
        {
            "metadata": {"name": "secure-epp-tls", "namespace": ns},
            "type": "kubernetes.io/tls",
            "data": {k: base64.b64encode(v).decode() for k, v in tls_data.items()},
        },
    )
    manifest = with_engine(without_gpus(renamed(load_example("agg"), name, ns)), speedup=SPEEDUP)
    manifest = with_replicas(manifest, "worker", 2)
    manifest["spec"]["kvEvents"] = {"curve": True}
    manifest["spec"]["services"]["epp"]["tls"] = {"mode": "Secret", "secretName": "secure-epp-tls"}
    await cluster.apply_graph(manifest)
    await cluster.wait_graph_state(ns, name, "ready", READY_S)

    (epp,) = await service_pods(cluster, ns, name, "epp")
    epp_ip = epp["status"]["podIP"]
    # The EPP serves the Secret's certificate, not one of its own making.
    assert await served_certificate(epp_ip, 9002) == pair.certificate.public_bytes(
        serialization.Encoding.DER
    )

    curve = await cluster.api.get(SECRETS, ns, f"{name}-kv-curve")
    assert curve is not None, "the operator made no CURVE Secret"
    keys_dir = tmp_path / "kv-curve"
    keys_dir.mkdir()
    for file, content in podlib.object_data("secret", curve).items():
        (keys_dir / file).write_bytes(content)

    async with (
        run_gateway(cluster.api, ns, name, tmp_path / "envoy") as envoy,
        aiohttp.ClientSession() as http,
    ):
        await wait_epp_knows(cluster, http, ns, name, {"aggregated": 2})
        # Through Envoy, whose ext_proc connection to the EPP is TLS with that certificate.
        replies = await run_families(http, envoy.url, MODEL, prompt_families(3, variants=3))
        flat = [r for family in replies for r in family]
        assert not failures(flat), failures(flat)
        assert not affinity_breaks(replies, lambda r: r.decode_worker)

        async def indexed():
            text = await scrape(http, f"http://{epp_ip}:9090/metrics")
            batches = metric_sum(text, "dynamograph_epp_kv_event_batches_total")
            blocks = metric_sum(text, "dynamograph_epp_index_blocks")
            return (batches, blocks) if batches and blocks else None

        # The EPP subscribed to the workers' KV events and indexed them ...
        await wait_for(indexed, "the EPP to index KV events", within=30, detail=cluster.describe)

        # ... which the workers publish only to CURVE clients holding the graph's keys: a
        # replay with the Secret's keys gets the batches of every worker that served.
        served = {r.decode_worker for r in flat}
        for worker in await service_pods(cluster, ns, name, "worker"):
            if instance_id(worker["metadata"]["name"]) not in served:
                continue
            async with http.get(f"http://{worker['status']['podIP']}:8000/v1/engine") as r:
                engine = await r.json()
            replay = engine["kv_events"]["replay_endpoint"]
            assert await replayed_batches(replay, CurveKeys.load(keys_dir)) > 0, replay

    await delete_and_wait_gone(cluster, ns, name)
