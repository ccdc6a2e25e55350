"""High availability: two `dynamograph operator --peering` processes share one ClusterKopfPeering.

Each process authenticates with its own bearer token, so the emulator's request log says which
replica did what. Without the peering object the operator refuses to start; with it, the first
one leads; the second registers in the peering object, sees the leader's higher priority and
stays paused (it never even watches DynamoGraphs); when the leader stops (SIGTERM: it removes
itself from the peering object), the second resumes and reconciles.
"""

import asyncio

import pytest

from e2e.waiting import wait_for

from .emulator import NAMESPACE, authorization, write_kubeconfig
from .processes import operator_process, stop
from .test_operator import GRAPH_PATH, GRAPHS, live

pytestmark = [
    pytest.mark.operator,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),
]

PEERING = "dynamograph"
PEERINGS = "kopf.dev/v1/clusterkopfpeerings"


def requests_by(cluster, token: str) -> list:
    return [r for r in list(cluster) if authorization(r) == f"Bearer {token}"]


def peers(cluster) -> dict:
    try:
        obj = cluster.objects[PEERINGS, None, PEERING]
    except KeyError:
        return {}
    return {} if obj.deleted else obj.raw.get("status") or {}


def named(r) -> str:
    data = r.data if isinstance(r.data, dict) else {}
    return f"{r.method.name} {r.url.path} {(data.get('metadata') or {}).get('name', '')}".strip()


def _startup_read(r) -> bool:
    """What every replica reads when it starts (operator/crd_upgrade.py): the CRD it upgrades,
    then one list of all graphs until the apiserver serves them (a leader's kopf lists them
    too, but then watches, `?watch=true`, which this keeps)."""
    if r.url.path.startswith("/apis/apiextensions.k8s.io/"):
        return True
    return r.method == "GET" and r.url.path == f"/apis/{GRAPHS}" and "watch" not in r.url.query


def graph_work(requests: list) -> list:
    """The requests that do an operator's work (all but kopf's peering keep-alives, API
    discovery and the reads every replica makes when it starts), as "METHOD path [name of a
    created object]"."""
    return [
        named(r)
        for r in requests
        if not r.url.path.startswith("/apis/kopf.dev/")
        and not _startup_read(r)
        and (r.method != "GET" or "/namespaces/" in r.url.path or "dynamographs" in r.url.path)
    ]


async def create_graph(cluster, name: str) -> None:
    """A one-service graph: few objects, so few events for the replicas to handle."""
    body = {
        "apiVersion": "dynamograph.io/v1alpha1",
        "kind": "DynamoGraph",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"name": "Qwen/Qwen3-0.6B"},
            "services": {"worker": {"componentType": "worker", "replicas": 1}},
        },
    }
    response = await cluster.post(GRAPH_PATH, json=body)
    assert response.status in (200, 201), await response.text()


async def wait_ready(cluster, name: str, log_hint: str) -> None:
    def ready():
        return ((live(cluster, GRAPHS, name) or {}).get("status") or {}).get("state") == "ready"

    await wait_for(ready, f"graph {name} ready ({log_hint})", within=60)


async def test_one_replica_leads_and_the_other_takes_over(cluster, tmp_path):
    url = str(cluster.url)
    env_a = {"KUBECONFIG": str(write_kubeconfig(tmp_path / "a", url, {"token": "replica-a"}))}
    env_b = {"KUBECONFIG": str(write_kubeconfig(tmp_path / "b", url, {"token": "replica-b"}))}
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    hint = f"logs: {log_a}, {log_b}"

    # No peering object: kopf would wait for it silently; the operator refuses to start.
    refused_log = tmp_path / "refused.log"
    async with operator_process(refused_log, "--peering", PEERING, env=env_a) as refused:
        await asyncio.wait_for(refused.wait(), 60)
    assert refused.returncode == 1
    assert f"peering object missing: ClusterKopfPeering {PEERING}" in refused_log.read_text()

    peering = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering"}
    response = await cluster.post(
        f"/apis/{PEERINGS}", json={**peering, "metadata": {"name": PEERING}}
    )
    assert response.status in (200, 201), await response.text()
    async with operator_process(log_a, "--peering", PEERING, env=env_a) as a:
        # Started first, so the older replica: it leads once it has registered.
        await wait_for(lambda: len(peers(cluster)) == 1, f"the first peer ({hint})", within=30)

        async with operator_process(log_b, "--peering", PEERING, env=env_b) as b:
            # The second replica registers, sees the older leader's higher priority, pauses.
            await wait_for(lambda: len(peers(cluster)) == 2, f"two peers ({hint})", within=30)
            priorities = sorted(p["priority"] for p in peers(cluster).values())
            assert priorities[0] != priorities[1]  # a tie would pause both

            # A graph while both run: reconciled by the leader alone.
            await create_graph(cluster, "g2")
            await wait_ready(cluster, "g2", hint)
            assert any("g2-worker" in w for w in graph_work(requests_by(cluster, "replica-a")))
            assert graph_work(requests_by(cluster, "replica-b")) == []

            # The leader stops; the standby resumes and serves the next graph.
            await stop(a)
            assert a.returncode == 0, log_a.read_text()[-3000:]
            await wait_for(lambda: len(peers(cluster)) == 1, f"the leader gone ({hint})", within=30)
            seen_a = len(requests_by(cluster, "replica-a"))
            await create_graph(cluster, "g3")
            await wait_ready(cluster, "g3", hint)
            b_work = graph_work(requests_by(cluster, "replica-b"))
            assert "POST /apis/apps/v1/namespaces/ns1/deployments g3-worker" in b_work
            assert live(cluster, "apps/v1/deployments", "g3-worker") is not None
            assert len(requests_by(cluster, "replica-a")) == seen_a
        assert b.returncode == 0, log_b.read_text()[-3000:]
