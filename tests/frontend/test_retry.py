"""A worker that never answers, behind a frontend that picks workers itself (round-robin):
each request to it gets its 504 after --first-byte-timeout and, as the client has been sent
nothing yet, goes to another worker once; the client sees only answers."""

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from dynamograph.frontend.routing import Mode
from dynamograph.worker.testing import mock_worker

from .conftest import client, frontend_metric, run_frontend, served

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def hung_engine(real_url: str) -> AsyncIterator[str]:
    """An engine whose GETs (/v1/engine, /metrics, /health) are a real worker's, and whose
    generation calls never get an answer (a hung engine that still looks healthy)."""
    held: list[asyncio.Event] = []

    async def forward(request: web.Request) -> web.Response:
        async with aiohttp.ClientSession() as http, http.get(real_url + request.path) as r:
            return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)

    async def hold(request: web.Request) -> web.Response:
        never = asyncio.Event()
        held.append(never)
        await never.wait()
        raise AssertionError("unreachable")

    app = web.Application()
    app.router.add_get("/{tail:.*}", forward)
    app.router.add_post("/{tail:.*}", hold)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


class Proxied:
    """A RunningWorker stand-in for run_frontend: the hung engine's URL, the real one's config."""

    def __init__(self, url: str, worker):
        self.url = url
        self.config = worker.config


async def test_a_hung_worker_costs_a_timeout_then_another_worker_answers(model):
    async with (
        mock_worker(name="retry-hung") as behind,
        mock_worker(name="retry-live") as live,
        hung_engine(behind.url) as hung_url,
        run_frontend(
            None, [Proxied(hung_url, behind), live], mode=Mode.ROUND_ROBIN, first_byte_timeout=1.0
        ) as fe,
    ):
        api = client(fe)
        for i in range(4):
            async with asyncio.timeout(30):  # without the first-byte timeout: 600 s
                completion = await api.completions.create(
                    model=model, prompt=f"question {i}", max_tokens=2
                )
            assert completion.choices[0].text
        assert await frontend_metric(fe, "dynamograph_frontend_retries_total") == 4
        assert (await served(live))["total"] == 4
