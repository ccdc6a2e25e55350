"""The EPP's watch of its pool's InferenceObjectives (epp/objectives.py) against kmock 0.8 (a
Kubernetes API emulator) on 127.0.0.1, through the official `kubernetes_asyncio` client:
objectives appear, change priority and go; another pool's never count."""

import pytest
from kubernetes_asyncio import client

from dynamograph.epp.objectives import GROUP, PLURAL, VERSION
from dynamograph.worker.testing import mock_worker
from e2e.waiting import wait_for

from .conftest import MODEL, running_epp

pytestmark = pytest.mark.integration

NS = "graphs"


def objective(name: str, pool: str, priority: int | None) -> dict:
    spec: dict = {"poolRef": {"name": pool}}
    if priority is not None:
        spec["priority"] = priority
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "resourceVersion": "1"},
        "spec": spec,
    }


async def test_the_epp_follows_its_pools_objectives(kmock):
    configuration = client.Configuration(host=str(kmock.url).rstrip("/"))
    async with client.ApiClient(configuration) as api:
        objectives = client.CustomObjectsApi(api)

        async def create(body: dict) -> None:
            await objectives.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)

        await create(objective("chat", "g1", 10))  # before the EPP starts: found by the list
        async with (
            mock_worker(model=MODEL, name="objectives-kmock") as worker,
            running_epp(
                [worker],
                objectives={"static": 3},
                pool_name="g1",
                pool_namespace=NS,
                kube_api=configuration,
            ) as epp,
        ):
            table = epp.objectives
            await wait_for(lambda: table.priority("chat") == 10, "the listed objective")
            await create(objective("batch", "g1", -5))  # found by the watch
            await create(objective("elsewhere", "g2", 50))  # another pool's
            await wait_for(lambda: table.priority("batch") == -5, "the watched objective")
            assert table.priority("elsewhere") == 0
            assert table.priority("static") == 3  # the static mapping stays ...
            await create(objective("static", "g1", None))  # ... until watched: unset = 0
            await wait_for(lambda: table.priority("static") == 0, "the unset priority")
            await objectives.patch_namespaced_custom_object(
                GROUP, VERSION, NS, PLURAL, "chat", {"spec": {"priority": 2}}
            )
            await wait_for(lambda: table.priority("chat") == 2, "the changed priority")
            await objectives.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "batch")
            await wait_for(lambda: table.priority("batch") == 0, "the deleted objective")
            assert table.priority(None) == 0
