"""Malformed HTTP gets a clear reply and the connection closed, never silence: the same table
of raw requests against the frontend's own HTTP/1.1 server (`frontend.http_server`, behind a
real `Frontend`) and the worker's (aiohttp, `worker.server`), both real servers on 127.0.0.1.

Each request goes over a raw socket; the reply's status is asserted and the connection must be
closed by the server, all within bounded timeouts. The 408 rows are the ones where slowness is
the behaviour under test: they run against servers started with 0.5 s head and body budgets.
"""

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from dynamograph.frontend.server import Frontend, FrontendConfig
from dynamograph.worker.testing import mock_worker
from e2e.waiting import wait_for

pytestmark = pytest.mark.integration

MODEL = "Qwen/Qwen3-0.6B"
BUDGET_S = 0.5  # head and body timeouts of the servers under test
MAX_BODY = 16 * 1024  # body cap of the servers under test
REPLY_WITHIN_S = 5.0  # every reply (and the close after it) comes within this


@dataclass(frozen=True)
class Case:
    name: str
    data: bytes
    status: int
    trickle: bytes = b""  # sent a byte every 0.1 s after `data` until the server closes


POST = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
GET = b"GET /health HTTP/1.1\r\nHost: t\r\n"
CHUNKED = POST + b"Transfer-Encoding: chunked\r\n\r\n"

CASES = [
    # 400: not HTTP, or HTTP with bad syntax
    Case("garbage", b"NOT HTTP AT ALL\r\n\r\n", 400),
    Case("space-in-target", b"GET /a b HTTP/1.1\r\nHost: t\r\n\r\n", 400),
    Case("control-char-in-target", b"GET /he\x01alth HTTP/1.1\r\nHost: t\r\n\r\n", 400),
    Case("target-not-a-path", b"GET health HTTP/1.1\r\nHost: t\r\n\r\n", 400),
    Case("bare-lf", b"GET /health HTTP/1.1\nHost: t\n\n", 400),
    Case("header-without-colon", GET + b"no colon here\r\n\r\n", 400),
    Case("space-in-header-name", GET + b"Bad Name: x\r\n\r\n", 400),
    Case("space-before-colon", b"GET /health HTTP/1.1\r\nHost : t\r\n\r\n", 400),
    Case("nul-in-header-value", GET + b"x-a: a\x00b\r\n\r\n", 400),
    Case("cr-in-header-value", GET + b"x-a: a\rb\r\n\r\n", 400),
    Case("obs-fold", GET + b"x-a: a\r\n folded\r\n\r\n", 400),
    Case("no-host", b"GET /health HTTP/1.1\r\n\r\n", 400),
    Case("two-hosts", GET + b"Host: u\r\n\r\n", 400),
    Case("content-length-not-a-number", POST + b"Content-Length: abc\r\n\r\n", 400),
    Case("content-length-negative", POST + b"Content-Length: -1\r\n\r\n", 400),
    Case("content-length-overflow", POST + b"Content-Length: 99999999999999999999999\r\n\r\n", 400),
    Case("two-content-lengths", POST + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400),
    Case(
        "content-length-and-chunked",
        POST + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        400,
    ),
    Case("chunked-not-last", POST + b"Transfer-Encoding: chunked, gzip\r\n\r\n", 400),
    Case("chunk-size-not-hex", CHUNKED + b"zz\r\n", 400),
    Case("chunk-without-crlf", CHUNKED + b"3\r\nabcXY", 400),
    Case("chunk-size-overflow", CHUNKED + b"ffffffffffffffffffff\r\n", 400),
    Case("chunk-extension-control-char", CHUNKED + b"3;\x01\r\nabc\r\n", 400),
    # 408: too slow (the servers' budgets are BUDGET_S)
    Case("slow-loris-stalled-head", b"GET /health HTTP/1.1\r\nHost: t\r\n", 408),
    Case("slow-loris-trickled-head", b"GET /health HTTP/1.1\r\nHost: t\r\nx-a: ", 408, b"a"),
    Case("stalled-body", POST + b'Content-Length: 100\r\n\r\n{"model"', 408),
    Case("trickled-body", POST + b"Content-Length: 900\r\n\r\n{", 408, b" "),
    Case("trickled-chunked-body", CHUNKED + b"1\r\n{\r\n", 408, b"1\r\n \r\n"),
    # 413: body over the cap
    Case("declared-body-too-large", POST + b"Content-Length: %d\r\n\r\n" % (MAX_BODY + 1), 413),
    Case(
        "chunked-body-too-large",
        CHUNKED + b"%x\r\n%s\r\n" % (MAX_BODY + 1, b" " * (MAX_BODY + 1)) + b"0\r\n\r\n",
        413,
    ),
    # 414 / 431: head too large
    Case("request-line-too-long", b"GET /" + b"a" * (70 * 1024) + b" HTTP/1.1\r\n\r\n", 414),
    Case("header-too-large", GET + b"x-big: " + b"a" * (70 * 1024) + b"\r\n\r\n", 431),
    Case("too-many-headers", GET + b"x-h: 1234567890\r\n" * 5000 + b"\r\n", 431),
    # 501: methods and transfer-codings not implemented
    Case("connect", b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n", 501),
    Case("trace", b"TRACE /health HTTP/1.1\r\nHost: t\r\n\r\n", 501),
    Case("options-star", b"OPTIONS * HTTP/1.1\r\nHost: t\r\n\r\n", 501),
    Case("unknown-method", b"BREW /pot HTTP/1.1\r\nHost: t\r\n\r\n", 501),
    Case("put", b"PUT /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n", 501),
    Case("gzip-transfer-coding", POST + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501),
    # 505: versions other than HTTP/1.0 and 1.1
    Case("http-1.2", b"GET /health HTTP/1.2\r\nHost: t\r\n\r\n", 505),
    Case("http-2-request-line", b"GET /health HTTP/2.0\r\nHost: t\r\n\r\n", 505),
    Case("http-2-prior-knowledge", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),
]


@dataclass(frozen=True)
class Served:
    port: int
    route: bytes = b""  # header lines that route a generation request to the mock engine


@contextlib.asynccontextmanager
async def frontend_port() -> AsyncIterator[Served]:
    async with mock_worker(model=MODEL, kv_events=False, speedup=1.0) as engine:
        config = FrontendConfig(
            engine_url=engine.url,
            max_body_bytes=MAX_BODY,
            head_timeout=BUDGET_S,
            body_timeout=BUDGET_S,
        )
        async with Frontend(config) as frontend:
            assert frontend.url is not None
            await wait_for(frontend.directory.ready, what="the frontend to know its engine")
            route = b"x-worker-instance-id: %d\r\n" % engine.config.instance_id
            yield Served(int(frontend.url.rsplit(":", 1)[1]), route)


@contextlib.asynccontextmanager
async def worker_port() -> AsyncIterator[Served]:
    async with mock_worker(
        model=MODEL,
        kv_events=False,
        speedup=1.0,
        max_body_bytes=MAX_BODY,
        head_timeout=BUDGET_S,
        body_timeout=BUDGET_S,
    ) as worker:
        yield Served(int(worker.url.rsplit(":", 1)[1]))


SERVERS = {"frontend": frontend_port, "worker": worker_port}


async def exchange(port: int, case: Case) -> tuple[bytes, bool]:
    """Send the case's bytes; the reply's first bytes and whether the server then closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            while True:
                await asyncio.sleep(0.1)  # slowness is the behaviour under test
                writer.write(case.trickle)
                await writer.drain()

    trickling = asyncio.create_task(trickle()) if case.trickle else None
    try:
        writer.write(case.data)
        with contextlib.suppress(ConnectionError):  # the server may close before reading all
            await writer.drain()
        reply = b""
        closed = False
        async with asyncio.timeout(REPLY_WITHIN_S):
            with contextlib.suppress(ConnectionError):
                while chunk := await reader.read(1 << 16):
                    reply += chunk
            closed = True
        return reply, closed
    except TimeoutError:
        return reply, False
    finally:
        if trickling is not None:
            trickling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await trickling
        writer.close()


@pytest.mark.parametrize("server", list(SERVERS))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_malformed_request_gets_its_status_and_the_connection_closed(server, case):
    async with SERVERS[server]() as served:
        reply, closed = await exchange(served.port, case)
    status_line = reply.split(b"\r\n", 1)[0]
    assert re.match(rb"HTTP/1\.[01] %d " % case.status, status_line), reply[:300]
    assert closed, f"the server kept the connection open after: {reply[:300]!r}"


@pytest.mark.parametrize("server", list(SERVERS))
async def test_json_nested_1000_deep_is_400_naming_the_limit(server):
    """Well-formed HTTP, a body whose nvext nests 1,000 deep: it was a RecursionError (500)
    in validation; both servers parse bodies with `protocol.openai.parse_json_body`."""
    body = b'{"model": "%s", "prompt": "hi", "nvext": ' % MODEL.encode()
    body += b'{"a": ' * 1000 + b"1" + b"}" * 1001
    head = POST + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    async with SERVERS[server]() as served:
        reply, _ = await exchange(served.port, Case("deep", head + body, 400))
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:300]
    assert b"deeper than 64 levels" in reply


@pytest.mark.parametrize("server", list(SERVERS))
async def test_a_late_pipelined_head_waits_for_the_answer_in_flight(server):
    """A request streams for ~2 s (simulated time at wall-clock speed) while the next one's
    head stalls on the same connection: the stream is answered whole, then the 408."""
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 300, "stream": true}' % MODEL.encode()
    stalled = b"GET /health HTTP/1.1\r\nHost: t\r\n"
    async with SERVERS[server]() as served:
        first = POST + served.route + b"Content-Length: %d\r\n\r\n" % len(body)
        case = Case("pipelined", first + body + stalled, 200)
        reply, closed = await exchange(served.port, case)
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:300]
    answer, _, after = reply.partition(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert answer.count(b"data: {") >= 2 and after.startswith(b"HTTP/1.1 408 "), reply[-300:]
    assert closed


@pytest.mark.parametrize("server", list(SERVERS))
async def test_a_pipelined_body_gets_its_time_once_its_turn_comes(server):
    """The frontend stops reading a pipelined request while the one before it streams (~2 s):
    its body's budget starts when it is taken up, not when its head came. The rest of its body
    follows 0.2 s after the first answer (slowness under test, within the 0.5 s budget)."""
    stream = b'{"model": "%s", "prompt": "hi", "max_tokens": 300, "stream": true}' % MODEL.encode()
    second = b'{"model": "%s", "prompt": "hi", "max_tokens": 1}' % MODEL.encode()
    async with SERVERS[server]() as served:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        first = POST + served.route + b"Content-Length: %d\r\n\r\n" % len(stream) + stream
        head = POST + served.route + b"Content-Length: %d\r\nConnection: close\r\n\r\n"
        writer.write(first + head % len(second) + second[:10])
        async with asyncio.timeout(REPLY_WITHIN_S):
            answer = await reader.readuntil(b"data: [DONE]\n\n\r\n0\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 200 ")
            await asyncio.sleep(0.2)  # slowness is the behaviour under test
            writer.write(second[10:])
            reply = await reader.read()
        writer.close()
    assert re.match(rb"HTTP/1\.[01] 200 ", reply), reply[:300]


@pytest.mark.parametrize("server", list(SERVERS))
async def test_a_well_formed_request_on_the_same_servers_is_served(server):
    """The table's servers serve what is not malformed (so their answers are not blanket)."""
    async with SERVERS[server]() as served:
        reply, _ = await exchange(served.port, Case("ok", GET + b"Connection: close\r\n\r\n", 200))
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:300]
