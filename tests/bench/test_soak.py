"""The soak's (and fault suite's) client: every way a request can end is told apart, and a hang
is bounded; the EPP's booking gauge is summed."""

import asyncio
import socket

import aiohttp
import pytest
from aiohttp import web

from dynamograph.bench.soak import (
    CUT,
    HTTP_ERROR,
    OK,
    REFUSED,
    STREAM_ERROR,
    UNANSWERED,
    MemorySample,
    SteadyLoad,
    booked_requests,
    classify,
    memory_growth,
    rss_growth,
)

pytestmark = pytest.mark.integration


async def stream(request: web.Request, events: list[bytes], end: bool = True):
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    for event in events:
        await resp.write(b"data: " + event + b"\n\n")
    if end:
        await resp.write_eof()
    else:  # drop the connection mid-stream, as a killed process does
        request.transport.close()
    return resp


async def handler(request: web.Request):
    kind = request.match_info["kind"]
    if kind == "ok":
        return await stream(request, [b'{"choices": []}', b"[DONE]"])
    if kind == "status":
        return web.json_response({"error": {"message": "no"}}, status=503)
    if kind == "error-event":
        return await stream(request, [b'{"choices": []}', b'{"error": {"message": "gone"}}'])
    if kind == "cut":
        return await stream(request, [b'{"choices": []}'], end=False)
    await request.app[RELEASE].wait()  # "hang": until the test's server stops
    return web.Response()


RELEASE = web.AppKey("release", asyncio.Event)


@pytest.fixture
async def server():
    app = web.Application()
    app[RELEASE] = asyncio.Event()
    app.router.add_post("/{kind}/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        app[RELEASE].set()
        await runner.cleanup()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_every_ending_has_its_category(server):
    async with aiohttp.ClientSession() as session:
        got = {
            kind: (await classify(session, f"{server}/{kind}", {}, 1.0))[0]
            for kind in ("ok", "status", "error-event", "cut", "hang")
        }
        refused = await classify(session, f"http://127.0.0.1:{closed_port()}", {}, 1.0)
    assert got == {
        "ok": OK,
        "status": HTTP_ERROR,
        "error-event": STREAM_ERROR,
        "cut": CUT,
        "hang": UNANSWERED,
    }
    assert refused[0] == REFUSED


async def test_steady_load_counts_outcomes_and_stops_within_its_bound(server):
    async with SteadyLoad(f"{server}/ok", "m", clients=2, timeout=1.0) as load:
        await load.wait_answered(5, within=10)
    assert load.outcomes.counts[OK] >= 5 and load.outcomes.lost == 0
    async with SteadyLoad(f"{server}/hang", "m", rate=20, timeout=0.5) as load:
        await asyncio.sleep(0.3)
    assert load.outcomes.counts[UNANSWERED] == load.outcomes.total > 0
    assert load.outcomes.lost == load.outcomes.total


@pytest.mark.parametrize("shape", [{"rate": 50}, {"clients": 3}])
async def test_paused_load_has_nothing_in_flight_and_sends_nothing_until_resumed(server, shape):
    async with SteadyLoad(f"{server}/ok", "m", timeout=1.0, **shape) as load:
        await load.wait_answered(3, within=10)
        await load.pause()
        paused_at = load.outcomes.total
        await asyncio.sleep(0.3)
        assert load.outcomes.total == paused_at  # everything sent had ended; nothing new
        load.resume()
        await load.wait_answered(3, within=10)
    assert load.outcomes.lost == 0


def test_booked_requests_sums_every_slot():
    text = (
        "# TYPE dynamograph_epp_worker_booked_requests gauge\n"
        'dynamograph_epp_worker_booked_requests{worker="a",dp_rank="0"} 2\n'
        'dynamograph_epp_worker_booked_requests{worker="b",dp_rank="0"} 1\n'
        'dynamograph_epp_worker_running_requests{worker="b",dp_rank="0"} 7\n'
    )
    assert booked_requests(text) == 3


def test_rss_growth_judges_only_processes_that_lived_through_the_window():
    first = MemorySample(0.0, {"epp": (10, 100), "worker": (11, 100)}, None, {})
    last = MemorySample(9.0, {"epp": (10, 104), "worker": (12, 50)}, None, {})
    assert rss_growth(first, last) == {"epp": pytest.approx(0.04)}  # the restarted one is not


def test_envoy_is_judged_by_its_live_heap_and_the_rest_by_rss():
    heap = "server.memory_allocated"
    first = MemorySample(0.0, {"envoy": (1, 100), "epp": (2, 100)}, None, {heap: 10})
    last = MemorySample(9.0, {"envoy": (1, 150), "epp": (2, 103)}, None, {heap: 10})
    assert memory_growth(first, last, "envoy") == {
        "envoy": pytest.approx(0.0),  # tcmalloc kept a burst's pages: RSS up, heap flat
        "epp": pytest.approx(0.03),
    }
    # without Envoy's heap (admin unreachable) its RSS is what is left to judge
    assert memory_growth(first, MemorySample(9.0, last.rss, None, {}), "envoy")[
        "envoy"
    ] == pytest.approx(0.5)
