"""Replica sync's peers from the EPP's own pods (router/replicas.py, `pod_selector`), watched with
the real `KubernetesSource` against kmock 0.8 (a Kubernetes API emulator) on 127.0.0.1: a peer
pod's bookings arrive once its pod is listed, whatever its readiness; the replica's own pod (its
host name) and another graph's EPP are no peers; a deleted pod is disconnected and its bookings
leave after the timeout."""

import contextlib
import socket

import pytest
from kubernetes_asyncio import client

from dynamograph.router.active import ActiveRequests
from dynamograph.router.replicas import ReplicaSettings, ReplicaSync
from e2e.waiting import wait_for

pytestmark = pytest.mark.integration

NS = "graphs"
LABELS = {"dynamograph.io/graph": "g1", "dynamograph.io/component-type": "epp"}
SELECTOR = ",".join(f"{k}={v}" for k, v in LABELS.items())
TIMING = {"heartbeat_s": 0.1, "timeout_s": 1.0}


def _pod(name: str, ip: str, labels=LABELS) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "resourceVersion": "1",
            "labels": dict(labels),
        },
        "spec": {"containers": [{"name": "epp", "image": "dynamograph"}]},
        # not Ready: a starting or draining EPP still counts as a peer
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "False"}]},
    }


@contextlib.asynccontextmanager
async def replica(active: ActiveRequests, settings: ReplicaSettings):
    sync = ReplicaSync(active, settings)
    await sync.start()
    try:
        yield sync
    finally:
        await sync.close()


async def test_peers_come_from_the_epp_pods(kmock):
    configuration = client.Configuration(host=str(kmock.url).rstrip("/"))
    port = 0
    # Every EPP "pod" below listens on the same port of its own loopback address.
    async with contextlib.AsyncExitStack() as stack:
        peers = {}
        for ip, slot in (("127.0.0.1", (1, 0)), ("127.0.0.2", (2, 0))):
            active = ActiveRequests()
            sync = await stack.enter_async_context(
                replica(active, ReplicaSettings(f"tcp://{ip}:{port}", **TIMING))
            )
            port = int(sync.address.rsplit(":", 1)[1])
            active.book(slot, prompt_blocks=2, prefill_blocks=2)
            peers[ip] = slot
        mine = ActiveRequests()
        watching = ReplicaSettings(
            "tcp://127.0.0.3:0",
            pod_selector=SELECTOR,
            namespace=NS,
            pod_port=port,
            pod_api=configuration,
            **TIMING,
        )
        api_client = await stack.enter_async_context(client.ApiClient(configuration))
        v1 = client.CoreV1Api(api_client)
        # our own pod, and another graph's EPP, both at the first peer's address: not peers
        await v1.create_namespaced_pod(NS, _pod(socket.gethostname(), "127.0.0.1"))
        other = {**LABELS, "dynamograph.io/graph": "g2"}
        await v1.create_namespaced_pod(NS, _pod("other-epp", "127.0.0.1", other))
        sync = await stack.enter_async_context(replica(mine, watching))
        await v1.create_namespaced_pod(NS, _pod("epp-1", "127.0.0.2"))
        slot = peers["127.0.0.2"]
        await wait_for(lambda: mine.load(slot).requests == 1, "epp-1's booking", within=20)
        assert sync.live_peers() == 1 and mine.load(peers["127.0.0.1"]).requests == 0
        await v1.delete_namespaced_pod("epp-1", NS)
        await wait_for(lambda: mine.load(slot).requests == 0, "its booking dropped", within=20)
        assert sync.dropped == 1
