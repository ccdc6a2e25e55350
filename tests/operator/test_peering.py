"""High availability: two `dynamograph operator --peering` processes share one ClusterKopfPeering.

Each process authenticates with its own bearer token, so the emulator's request log says which
replica did what. The first one leads; the second registers in the peering object, sees the
leader's higher priority and stays paused (it never even watches DynamoGraphs); when the leader
stops (SIGTERM: it removes itself from the peering object), the second resumes and reconciles.
"""

import asyncio

import pytest

from .emulator import authorization, wait_for, write_kubeconfig
from .processes import operator_process, stop
from .test_operator import GRAPH_PATH, GRAPHS, disagg_graph, live

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


async def create_ready_graph(cluster, name: str, log_hint: str) -> None:
    body = disagg_graph()
    body["metadata"]["name"] = name
    response = await cluster.post(GRAPH_PATH, json=body)
    assert response.status in (200, 201), await response.text()

    def ready():
        return ((live(cluster, GRAPHS, name) or {}).get("status") or {}).get("state") == "ready"

    await wait_for(ready, 60, f"graph {name} ready ({log_hint})")


def named(r) -> str:
    data = r.data if isinstance(r.data, dict) else {}
    return f"{r.method.name} {r.url.path} {(data.get('metadata') or {}).get('name', '')}".strip()


def graph_work(requests: list) -> list:
    """The requests that do an operator's work (all but kopf's peering keep-alives and API
    discovery), as "METHOD path [name of a created object]"."""
    return [
        named(r)
        for r in requests
        if not r.url.path.startswith("/apis/kopf.dev/")
        and (r.method != "GET" or "/namespaces/" in r.url.path or "dynamographs" in r.url.path)
    ]


async def test_one_replica_leads_and_the_other_takes_over(cluster, tmp_path):
    peering = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering"}
    response = await cluster.post(
        f"/apis/{PEERINGS}", json={**peering, "metadata": {"name": PEERING}}
    )
    assert response.status in (200, 201), await response.text()
    url = str(cluster.url)
    env_a = {"KUBECONFIG": str(write_kubeconfig(tmp_path / "a", url, {"token": "replica-a"}))}
    env_b = {"KUBECONFIG": str(write_kubeconfig(tmp_path / "b", url, {"token": "replica-b"}))}
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    hint = f"logs: {log_a}, {log_b}"

    async with operator_process(log_a, "--peering", PEERING, env=env_a) as a:
        # Started first, so the older replica: it leads once it has registered.
        await wait_for(lambda: len(peers(cluster)) == 1, 30, f"the first peer ({hint})")

        async with operator_process(log_b, "--peering", PEERING, env=env_b) as b:
            await wait_for(lambda: len(peers(cluster)) == 2, 30, f"two peers ({hint})")
            priorities = sorted(p["priority"] for p in peers(cluster).values())
            assert priorities[0] != priorities[1]  # a tie would pause both

            # A graph while both run: reconciled by the leader alone.
            await create_ready_graph(cluster, "g2", hint)
            assert any("g2-decode" in w for w in graph_work(requests_by(cluster, "replica-a")))
            assert graph_work(requests_by(cluster, "replica-b")) == []

            # The leader stops; the standby resumes and serves the next graph.
            await stop(a)
            assert a.returncode == 0, log_a.read_text()[-3000:]
            await wait_for(lambda: len(peers(cluster)) == 1, 30, f"the leader gone ({hint})")
            seen_a = len(requests_by(cluster, "replica-a"))
            await create_ready_graph(cluster, "g3", hint)
            b_writes = graph_work(requests_by(cluster, "replica-b"))
            assert "POST /apis/apps/v1/namespaces/ns1/deployments g3-decode" in b_writes
            assert live(cluster, "apps/v1/deployments", "g3-decode") is not None
            assert len(requests_by(cluster, "replica-a")) == seen_a
        assert b.returncode == 0, log_b.read_text()[-3000:]


async def test_a_missing_peering_object_is_reported_and_waited_for(cluster, tmp_path):
    """kopf keeps a peered operator paused until its peering object exists, silently: the
    operator says so at startup, and starts working as soon as the object is created."""
    log = tmp_path / "operator.log"
    env = {"KUBECONFIG": str(write_kubeconfig(tmp_path / "a", str(cluster.url), {"token": "a"}))}
    async with operator_process(log, "--peering", PEERING, env=env) as proc:
        await wait_for(
            lambda: "peering object(s) missing" in log.read_text(), 30, f"the error ({log})"
        )
        assert f"ClusterKopfPeering {PEERING}" in log.read_text()
        body = disagg_graph()
        response = await cluster.post(GRAPH_PATH, json=body)
        assert response.status in (200, 201), await response.text()
        await asyncio.sleep(1.0)  # paused: the operator does not even watch graphs
        assert graph_work(requests_by(cluster, "a")) == []

        peering = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering"}
        response = await cluster.post(
            f"/apis/{PEERINGS}", json={**peering, "metadata": {"name": PEERING}}
        )
        assert response.status in (200, 201), await response.text()

        def ready():
            return ((live(cluster, GRAPHS, "g") or {}).get("status") or {}).get("state") == "ready"

        await wait_for(ready, 60, f"the graph reconciled once the peering object exists ({log})")
    assert proc.returncode == 0, log.read_text()[-3000:]
