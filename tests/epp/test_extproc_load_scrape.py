"""The load scraper against a real HTTP server on 127.0.0.1: vLLM's series per DP rank read into
the router, a chunked page, one keep-alive connection across scrapes, and failures (HTTP
errors, a server gone) counted until the worker is reported unreachable."""

import asyncio
from types import SimpleNamespace

import pytest
from aiohttp import web

from dynamograph.router.load import LoadScraper
from dynamograph.router.scheduler import Router

pytestmark = pytest.mark.integration

WID = 7
PAGE = b"""# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 5.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
"""


class MetricsServer:
    """/metrics as a real server sends it: whole, chunked, or an error; counts connections."""

    def __init__(self):
        self.mode = "whole"
        self.peers: set = set()

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        self.peers.add(request.transport.get_extra_info("peername"))
        if self.mode == "error":
            return web.Response(status=500, text="engine is sick")
        if self.mode == "chunked":
            response = web.StreamResponse(headers={"Content-Type": "text/plain"})
            response.enable_chunked_encoding()
            await response.prepare(request)
            for i in range(0, len(PAGE), 100):
                await response.write(PAGE[i : i + 100])
            await response.write_eof()
            return response
        return web.Response(body=PAGE, content_type="text/plain")


@pytest.fixture
async def served():
    server = MetricsServer()
    app = web.Application()
    app.router.add_get("/metrics", server.metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield server, runner, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _router() -> Router:
    router = Router()
    router.add_worker(WID, dp_size=2, block_size=16, total_blocks=1024)
    return router


async def test_scrapes_read_every_rank_over_one_kept_alive_connection(served):
    server, _, url = served
    router = _router()
    scraper = LoadScraper(router, timeout=5.0)
    record = SimpleNamespace(instance_id=WID, engine_url=url, name="w")
    try:
        for mode in ("whole", "chunked", "whole"):
            server.mode = mode
            assert await scraper.scrape(record)
            state = router.workers()[WID]
            assert (state.waiting, state.running, state.kv_usage) == ([3, 5], [2, 4], [0.25, 0.5])
        assert len(server.peers) == 1  # one connection, kept alive across the scrapes
    finally:
        await scraper.close()


async def test_failures_are_counted_until_the_worker_is_unreachable(served):
    server, runner, url = served
    unreachable: list[int] = []
    scraper = LoadScraper(_router(), timeout=5.0, on_unreachable=unreachable.append)
    record = SimpleNamespace(instance_id=WID, engine_url=url, name="w")
    try:
        server.mode = "error"
        assert not await scraper.scrape(record)
        assert unreachable == []  # one failure is not enough
        server.mode = "whole"
        assert await scraper.scrape(record)  # a success resets the count
        server.mode = "error"
        assert not await scraper.scrape(record)
        await runner.cleanup()  # the server goes away: connection refused
        assert not await scraper.scrape(record)
        assert unreachable == [WID]
    finally:
        await scraper.close()


async def test_a_silent_server_times_out():
    writers = []

    async def silent(reader, writer):  # accepts, never answers
        writers.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    scraper = LoadScraper(_router(), timeout=0.3)
    record = SimpleNamespace(instance_id=WID, engine_url=f"http://127.0.0.1:{port}", name="w")
    try:
        async with asyncio.timeout(10):
            assert not await scraper.scrape(record)
    finally:
        await scraper.close()
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()
