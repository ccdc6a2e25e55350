"""The EPP's watch of its pool's InferenceObjectives (epp/objectives.py) against kmock 0.8 (a
Kubernetes API emulator) on 127.0.0.1, through the official `kubernetes_asyncio` client:
objectives appear, change priority and go; another pool's never count. And against an API
that does not serve the kind yet (no CRD)."""

import asyncio
import logging

import pytest
from aiohttp import web
from kubernetes_asyncio import client

from dynamograph.epp.objectives import GROUP, PLURAL, VERSION, ObjectiveTable, objective_watch
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


async def test_without_the_crd_the_watch_says_so_once_and_finds_it_once_installed(caplog):
    """An API that does not serve InferenceObjectives (404: GAIE's CRD not installed): one
    warning, then the watch keeps looking, and follows the objectives once they are served."""
    served = asyncio.Event()
    done = asyncio.Event()
    calls: list[str] = []

    async def objectives(request: web.Request) -> web.StreamResponse:
        calls.append(request.query.get("watch", "list"))
        if not served.is_set():
            if len(calls) >= 3:
                served.set()  # the CRD gets installed
            status = {"kind": "Status", "code": 404, "reason": "NotFound"}
            return web.json_response(status, status=404)
        if request.query.get("watch") != "true":
            return web.json_response(
                {"metadata": {"resourceVersion": "5"}, "items": [objective("chat", "g1", 5)]}
            )
        response = web.StreamResponse()
        await response.prepare(request)
        await done.wait()  # a watch with nothing to say, until the test ends
        return response

    app = web.Application()
    app.router.add_get(f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}", objectives)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    table = ObjectiveTable()
    watch = objective_watch(
        NS, "g1", client.Configuration(host=f"http://127.0.0.1:{port}"), missing_interval=0.01
    )
    task = asyncio.create_task(watch.run(table))
    try:
        with caplog.at_level(logging.WARNING, logger="dynamograph.router.discovery"):
            await wait_for(lambda: table.priority("chat") == 5, "the objective once served")
        assert watch.missing == 3
        warnings = [r for r in caplog.records if "does not serve" in r.getMessage()]
        assert len(warnings) == 1 and "inferenceobjective" in warnings[0].getMessage()
    finally:
        done.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runner.cleanup()
