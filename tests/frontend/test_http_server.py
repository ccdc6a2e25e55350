"""The frontend's own HTTP/1.1 server (`frontend.http_server`) over real sockets on 127.0.0.1:
framing, keep-alive, pipelining, bad requests, Expect, disconnects, flow control, stop."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httptools
import pytest

from dynamograph.frontend import http_server
from dynamograph.frontend.http_server import BodyTooLarge, ClientGone, Exchange, HttpServer
from e2e.waiting import wait_for

pytestmark = pytest.mark.integration


class App:
    """Paths: /echo (body back, 1000 B cap; /echo-large: 1 MiB), /stream (three chunks), /slow
    (waits to be released, armed for disconnects), /boom (raises), /silent (returns without
    answering), /big (a large whole body)."""

    def __init__(self):
        self.release = asyncio.Event()
        self.cancelled = 0
        self.gone_before_body = 0
        self.started = asyncio.Event()

    async def __call__(self, exchange: Exchange) -> None:
        if exchange.path in ("/echo", "/echo-large"):
            try:
                body = await exchange.body(1000 if exchange.path == "/echo" else 1 << 20)
            except BodyTooLarge:
                await exchange.respond(413, b"too large", [])
                return
            except ClientGone:
                self.gone_before_body += 1
                return
            headers = [(b"x-method", exchange.method.encode())]
            await exchange.respond(200, body, headers)
        elif exchange.path == "/stream":
            await exchange.start(200, [(b"content-type", b"text/event-stream")])
            for i in range(3):
                await exchange.write(b"data: %d\n\n" % i)
            await exchange.end()
        elif exchange.path == "/slow":
            exchange.cancel_on_disconnect()
            self.started.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            await exchange.respond(200, b"late", [])
        elif exchange.path == "/boom":
            raise RuntimeError("a bug")
        elif exchange.path == "/silent":
            return
        elif exchange.path == "/big":
            await exchange.respond(200, b"x" * (8 << 20), [])
        else:
            await exchange.respond(404, b"", [])


@asynccontextmanager
async def serving(app: App) -> AsyncIterator[tuple[HttpServer, int]]:
    server = HttpServer(app)
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await server.stop()


class Reply:
    def __init__(self, status: int = 0):
        self.status = status
        self.headers: dict[bytes, bytes] = {}
        self.body = b""


class Replies:
    """Responses parsed off one connection, in order (several may arrive in one read)."""

    def __init__(self, reader: asyncio.StreamReader):
        self.reader = reader
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[Reply] = []
        self.current: Reply | None = None

    def on_message_begin(self) -> None:
        self.current = Reply()

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.current is not None
        self.current.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        assert self.current is not None
        self.current.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        assert self.current is not None
        self.current.body += body

    def on_message_complete(self) -> None:
        assert self.current is not None
        self.done.append(self.current)

    async def next(self) -> Reply:
        while not self.done:
            data = await asyncio.wait_for(self.reader.read(1 << 16), 10)
            if not data:
                raise ConnectionError("closed before the response ended")
            self.parser.feed_data(data)
        return self.done.pop(0)


async def read_reply(reader: asyncio.StreamReader) -> Reply:
    """The one response expected on the connection."""
    return await Replies(reader).next()


def post(path: str, body: bytes, *extra: bytes) -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n" % (path.encode(), len(body))
    return head + b"".join(extra) + b"\r\n" + body


async def closed(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(), 10) == b""


async def test_keep_alive_and_pipelined_requests_are_answered_in_order():
    async with serving(App()) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/echo", b"one") + post("/echo", b"two") + post("/echo", b"three"))
        replies = Replies(reader)
        for expected in (b"one", b"two", b"three"):
            reply = await replies.next()
            assert (reply.status, reply.body) == (200, expected)
            assert reply.headers[b"content-length"] == str(len(expected)).encode()
        writer.write(post("/echo", b"again"))  # still open: keep-alive
        assert (await replies.next()).body == b"again"
        writer.close()


async def test_whole_response_goes_out_as_one_write():
    """Head and body in one write: the client's first read after the answer has it all."""
    async with serving(App()) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/echo", b"payload"))
        first = await asyncio.wait_for(reader.read(1 << 16), 10)
        assert first.startswith(b"HTTP/1.1 200 OK\r\n") and first.endswith(b"\r\n\r\npayload")
        writer.close()


async def test_streamed_response_is_chunked_and_its_head_rides_on_the_first_chunk():
    async with serving(App()) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
        reply = await read_reply(reader)
        assert reply.status == 200
        assert reply.headers[b"transfer-encoding"] == b"chunked"
        assert reply.body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        writer.close()


async def test_head_request_gets_the_head_only():
    async with serving(App()) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"HEAD /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert b"content-length: 3\r\n" in head and b"x-method: HEAD" in head
        writer.write(post("/echo", b"next"))  # nothing but the head came before this answer
        assert (await read_reply(reader)).body == b"next"
        writer.close()


async def test_http_1_0_and_connection_close_end_the_connection_after_the_answer():
    async with serving(App()) as (_, port):
        for request in (
            b"POST /echo HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi",
            post("/echo", b"hi", b"Connection: close\r\n"),
        ):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            reply = await read_reply(reader)
            assert reply.body == b"hi" and reply.headers[b"connection"] == b"close"
            assert await closed(reader)
            writer.close()


async def test_malformed_request_gets_a_plain_400_and_the_connection_closed():
    async with serving(App()) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), 10)
        assert data.startswith(b"HTTP/1.1 400 Bad Request\r\n")
        assert b"Invalid HTTP request received" in data
        writer.close()


async def test_oversized_head_gets_431():
    async with serving(App()) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /echo HTTP/1.1\r\nx-big: " + b"a" * (http_server.MAX_HEAD + 10))
        data = await asyncio.wait_for(reader.read(), 10)
        assert data.startswith(b"HTTP/1.1 431 ")
        writer.close()


async def test_expect_100_continue_is_answered_before_the_body_is_sent():
    async with serving(App()) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"
        )
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"body")
        assert (await read_reply(reader)).body == b"body"
        writer.close()


async def test_body_over_the_cap_is_refused_and_the_connection_not_reused():
    async with serving(App()) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # Declared too large: refused before it is sent, then the unread body ends the connection.
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\n\r\n")
        assert (await read_reply(reader)).status == 413
        assert await closed(reader)
        writer.close()
        # Chunked (no length), counted as it arrives.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        chunk = b"x" * 600
        writer.write(
            b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 2
            + b"0\r\n\r\n"
        )
        assert (await read_reply(reader)).status == 413
        writer.close()


async def test_a_large_body_in_the_same_read_as_its_head_is_not_a_large_head():
    async with serving(App()) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b"b" * (3 * http_server.MAX_HEAD)
        writer.write(post("/echo-large", body))
        reply = await read_reply(reader)
        assert reply.status == 200 and reply.body == body
        writer.close()


async def test_unhandled_error_or_no_answer_is_a_500_and_closes():
    async with serving(App()) as (_, port):
        for path in (b"/boom", b"/silent"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET %s HTTP/1.1\r\nHost: t\r\n\r\n" % path)
            reply = await read_reply(reader)
            assert reply.status == 500 and reply.headers[b"connection"] == b"close"
            assert await closed(reader)
            writer.close()


async def test_disconnect_cancels_an_armed_request_at_once():
    app = App()
    async with serving(app) as (server, port):
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.wait_for(app.started.wait(), 10)
        writer.close()
        await wait_for(lambda: app.cancelled == 1, what="the request's task to be cancelled")
        await wait_for(lambda: not server.tasks and not server.connections, what="cleanup")


async def test_disconnect_while_the_body_arrives_is_client_gone():
    app = App()
    async with serving(app) as (server, port):
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\npart")
        await writer.drain()
        await wait_for(lambda: server.tasks, "the request to reach its handler")
        writer.close()
        await wait_for(lambda: app.gone_before_body == 1, what="the body read to fail")
        await wait_for(lambda: not server.tasks, what="the request to end")


async def test_a_client_not_reading_pauses_the_writer_and_gets_everything_later():
    async with serving(App()) as (server, port):
        # The reader's default limit (64 KiB): it stops taking data off the socket at twice that,
        # so the kernel buffers fill and the 8 MiB answer stays paused until we read (a larger
        # limit let the reader absorb the whole answer and the pause pass unseen).
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /big HTTP/1.1\r\nHost: t\r\n\r\n")
        await wait_for(  # the socket buffers fill up: the server waits for us
            lambda: any(c._writing_paused for c in server.connections),
            "the server to pause writing",
            within=10,
        )
        reply = await read_reply(reader)
        assert reply.status == 200 and len(reply.body) == 8 << 20
        writer.close()


async def test_idle_connections_are_closed_after_the_keep_alive_time(monkeypatch):
    monkeypatch.setattr(http_server, "KEEP_ALIVE_S", 0.2)
    monkeypatch.setattr(http_server, "_SWEEP_S", 0.05)
    async with serving(App()) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/echo", b"x"))
        assert (await read_reply(reader)).body == b"x"
        assert await closed(reader)
        writer.close()


async def test_stop_finishes_requests_in_flight_closes_idle_ones_and_refuses_new():
    app = App()
    server = HttpServer(app)
    port = await server.start("127.0.0.1", 0)
    busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", port)
    idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
    idle_writer.write(post("/echo", b"x"))
    assert (await read_reply(idle_reader)).body == b"x"
    busy_writer.write(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
    await asyncio.wait_for(app.started.wait(), 10)

    stopping = asyncio.create_task(server.stop())
    assert await closed(idle_reader)
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)
    app.release.set()
    reply = await read_reply(busy_reader)
    assert reply.body == b"late" and reply.headers[b"connection"] == b"close"
    await asyncio.wait_for(stopping, 10)
    assert await closed(busy_reader)
    busy_writer.close()
    idle_writer.close()


async def test_stop_cancels_what_outlives_the_grace_period(monkeypatch):
    monkeypatch.setattr(http_server, "GRACEFUL_S", 0.2)
    app = App()
    server = HttpServer(app)
    port = await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
    await asyncio.wait_for(app.started.wait(), 10)
    await asyncio.wait_for(server.stop(), 10)
    assert app.cancelled == 1
    assert await closed(reader)
    writer.close()
