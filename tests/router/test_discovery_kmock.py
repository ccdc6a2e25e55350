"""Kubernetes pod discovery against kmock 0.8 (a Kubernetes API emulator) on 127.0.0.1.

The source is the real `KubernetesSource` with the official `kubernetes_asyncio` client; pods are
created, patched Ready, marked terminating and deleted through the same API.
"""

import asyncio

import kmock as kmock_lib
import pytest
from kubernetes_asyncio import client

from dynamograph.router.discovery import KubernetesSource, WorkerTarget
from e2e.waiting import wait_for

pytestmark = pytest.mark.integration

NS = "graphs"
SELECTOR = "dynamograph.io/graph=g1"


class RecordingSink:
    def __init__(self):
        self.targets: dict[str, WorkerTarget] = {}
        self.syncs = 0

    def sync(self, targets):
        self.syncs += 1
        self.targets = {t.key: t for t in targets}

    def upsert(self, target):
        self.targets[target.key] = target

    def remove(self, key):
        self.targets.pop(key, None)


def _pod(name, *, graph="g1", ready=False, ip="127.0.0.1", engine=8000, http=8080):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "resourceVersion": "1",
            "labels": {"dynamograph.io/graph": graph},
        },
        "spec": {
            "containers": [
                {
                    "name": "engine",
                    "image": "dynamograph",
                    "ports": [
                        {"name": "http", "containerPort": http},
                        {"name": "engine", "containerPort": engine},
                    ],
                }
            ]
        },
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


@pytest.fixture
async def api(kmock):
    configuration = client.Configuration(host=str(kmock.url).rstrip("/"))
    async with client.ApiClient(configuration) as api_client:
        yield configuration, client.CoreV1Api(api_client)


async def test_pods_appear_turn_ready_and_terminate(kmock, api):
    configuration, v1 = api
    # One pod exists before the watch starts (found by the list), one arrives later (watch).
    await v1.create_namespaced_pod(NS, _pod("w-0", ready=True, engine=8100, http=8180))
    source = KubernetesSource(NS, SELECTOR, configuration, watch_timeout=5)
    sink = RecordingSink()
    task = asyncio.create_task(source.run(sink))
    try:
        await wait_for(
            lambda: f"{NS}/w-0" in sink.targets, "w-0 discovered", within=30, interval=0.01
        )
        assert sink.targets[f"{NS}/w-0"] == WorkerTarget(
            f"{NS}/w-0", "http://127.0.0.1:8100", "127.0.0.1:8180"
        )

        # A new pod that is not Ready yet is not a target; once Ready, it is.
        await v1.create_namespaced_pod(NS, _pod("w-1", ready=False, engine=8101, http=8181))
        # Another graph's pod never shows up, even Ready.
        await v1.create_namespaced_pod(NS, _pod("other", graph="g2", ready=True, engine=8102))
        # A Ready pod of this graph created after them: once it is a target, the watch has
        # delivered the two pods before it too.
        await v1.create_namespaced_pod(NS, _pod("marker", ready=True, engine=8103, http=8183))
        await wait_for(
            lambda: f"{NS}/marker" in sink.targets, "marker discovered", within=30, interval=0.01
        )
        assert set(sink.targets) == {f"{NS}/w-0", f"{NS}/marker"}
        await v1.delete_namespaced_pod("marker", NS)
        await wait_for(
            lambda: f"{NS}/marker" not in sink.targets, "marker gone", within=30, interval=0.01
        )
        await v1.patch_namespaced_pod(
            "w-1", NS, {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
        )
        await wait_for(
            lambda: f"{NS}/w-1" in sink.targets, "w-1 discovered", within=30, interval=0.01
        )
        assert sink.targets[f"{NS}/w-1"].engine_url == "http://127.0.0.1:8101"

        # Terminating (deletionTimestamp set) removes it before the pod is gone.
        await v1.patch_namespaced_pod(
            "w-1", NS, {"metadata": {"deletionTimestamp": "2026-11-21T16:00:00Z"}}
        )
        await wait_for(
            lambda: f"{NS}/w-1" not in sink.targets, "w-1 gone", within=30, interval=0.01
        )
        # Deleting a Ready pod removes it too.
        await v1.delete_namespaced_pod("w-0", NS)
        await wait_for(lambda: not sink.targets, "every target gone", within=30, interval=0.01)
        assert source.relists == 1
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_watch_410_gone_relists(kmock, api):
    configuration, v1 = api
    await v1.create_namespaced_pod(NS, _pod("w-0", ready=True))
    # The first watch answers 410 Gone (history compacted): the source must relist.
    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}
    kmock[kmock_lib.resource("", "v1", "pods")]["watch"][:1] << (gone,)
    source = KubernetesSource(NS, SELECTOR, configuration, watch_timeout=5)
    sink = RecordingSink()
    task = asyncio.create_task(source.run(sink))
    try:
        await wait_for(lambda: source.relists >= 2, "a second relist", within=30, interval=0.01)
        await wait_for(
            lambda: f"{NS}/w-0" in sink.targets, "w-0 discovered", within=30, interval=0.01
        )
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_discovery_records_come_from_the_pods_engine(kmock, api):
    from dynamograph.router.discovery import Discovery
    from dynamograph.worker.testing import mock_worker

    configuration, v1 = api
    async with mock_worker(model="Qwen/Qwen3-0.6B", name="pod-w-0") as worker:
        engine_port = int(worker.url.rsplit(":", 1)[1])
        discovery = Discovery(KubernetesSource(NS, SELECTOR, configuration, watch_timeout=5))
        added, removed = [], []
        discovery.add_listener(added.append, removed.append)
        # The pod exists before discovery lists: kmock answers 404 for a kind it holds no
        # object of (a real API server always serves pods), which discovery takes for a CRD
        # not installed yet and looks for again only after 30 s.
        await v1.create_namespaced_pod(NS, _pod("w-0", ready=True, engine=engine_port))
        await discovery.start()
        try:
            await wait_for(lambda: added, "an addition", within=30, interval=0.01)
            record = added[0]
            assert record.instance_id == worker.config.instance_id
            assert record.engine_url == worker.url
            assert record.serving_endpoint == "127.0.0.1:8080"
            assert record.config.kv_cache_block_size == worker.config.kv_cache_block_size
            assert discovery.endpoint_of(record.instance_id) == "127.0.0.1:8080"
            await v1.delete_namespaced_pod("w-0", NS)
            await wait_for(lambda: removed, "a removal", within=30, interval=0.01)
            assert removed[0].instance_id == record.instance_id
            assert discovery.get(record.instance_id) is None
        finally:
            await discovery.stop()
