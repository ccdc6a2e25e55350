"""The lean HTTP/1.1 engine client against real sockets that answer with hand-written bytes:
framing (content-length, chunked split anywhere, until close), keep-alive reuse, the stale
connection retry, malformed answers, timeouts, and closing a response cut short."""

import asyncio
import contextlib

import pytest

from dynamograph.protocol.http1 import ConnectError, Http1Pool, ProtocolError
from dynamograph.worker.testing import refusing_address

pytestmark = pytest.mark.integration


class RawServer:
    """Answers each request (read up to the blank line and its Content-Length body) with the
    next scripted reply: bytes written `step` bytes at a time, `pause` seconds apart; `close`
    after it."""

    def __init__(
        self,
        replies,
        *,
        step: int | None = None,
        pause: float = 0.001,
        close_after: bool = False,
    ):
        self.replies = list(replies)
        self.step = step
        self.pause = pause
        self.close_after = close_after
        self.connections = 0
        self.requests: list[bytes] = []
        self.disconnected = asyncio.Event()
        self.url = ""

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while self.replies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.requests.append(head + await reader.readexactly(length))
                reply = self.replies.pop(0)
                step = self.step or len(reply) or 1
                for i in range(0, len(reply), step):
                    writer.write(reply[i : i + step])
                    await writer.drain()
                    if self.step:  # a slow server, dribbling its reply (the behaviour under test)
                        await asyncio.sleep(self.pause)
                if self.close_after:
                    return  # (finally) close the connection after this reply
            await reader.read()  # until the client hangs up
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client hung up, or the test is over
        finally:
            self.disconnected.set()
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


def pool(read_timeout: float | None = 5.0) -> Http1Pool:
    return Http1Pool(connect_timeout=2.0, read_timeout=read_timeout)


JSON = (
    b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n{"ok": true}'
)
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"b\r\ndata: one\n\n\r\n"
    b"B;ext=1\r\ndata: two\n\n\r\n"
    b"0\r\nX-Trailer: t\r\n\r\n"
)


@pytest.mark.parametrize("step", [None, 1, 5])
async def test_chunked_body_whatever_the_split(step):
    async with RawServer([CHUNKED, CHUNKED], step=step) as server:
        client = pool()
        response = await client.request(b"POST", server.url, "/v1/x", b"", b"{}")
        assert response.status == 200 and response.content_type == "text/event-stream"
        pieces = []
        while chunk := await response.read_chunk():
            pieces.append(chunk)
        assert b"".join(pieces) == b"data: one\n\ndata: two\n\n" and response.is_eof()
        response.release()
        again = await client.request(b"POST", server.url, "/v1/x", b"", b"{}")
        assert await again.read() == b"data: one\n\ndata: two\n\n"
        again.release()
        assert server.connections == 1  # kept alive and reused
        assert server.requests[0].startswith(b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b"Content-Length: 2\r\n" in server.requests[0]
        await client.close()


async def test_content_length_and_headers():
    async with RawServer([JSON]) as server:
        client = pool()
        response = await client.request(
            b"POST", server.url, "/p", b"X-data-parallel-rank: 1\r\n", b"{}"
        )
        assert response.headers["content-type"] == "application/json"
        assert await response.read() == b'{"ok": true}'
        assert b"X-data-parallel-rank: 1\r\n" in server.requests[0]
        response.release()
        await client.close()


async def test_stale_pooled_connection_is_retried_once():
    async with RawServer([JSON, JSON], close_after=True) as server:
        client = pool()
        first = await client.request(b"GET", server.url, "/a")
        assert await first.read() == b'{"ok": true}'
        first.release()  # pooled, but the server closes it
        await server.disconnected.wait()
        second = await client.request(b"GET", server.url, "/b")
        assert await second.read() == b'{"ok": true}' and server.connections == 2
        second.release()
        await client.close()


async def test_body_until_close_and_connection_close_header():
    reply = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it"
    async with RawServer([reply], close_after=True) as server:
        client = pool()
        response = await client.request(b"GET", server.url, "/")
        assert await response.read() == b"all of it"
        response.release()
        assert not any(client._idle.values())  # not reusable
        await client.close()


async def test_malformed_answer_is_a_protocol_error():
    async with RawServer([b"SPDY/3 200 OK\r\n\r\n"]) as server:
        client = pool()
        with pytest.raises(ProtocolError, match="bad status line"):
            await client.request(b"GET", server.url, "/")
        await client.close()


async def test_silent_engine_times_out_and_refused_connect_fails():
    partial = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nnot all"
    async with RawServer([partial]) as server:
        client = pool(read_timeout=0.2)
        response = await client.request(b"GET", server.url, "/")
        with pytest.raises(TimeoutError):
            await response.read()
        response.close()
        await asyncio.wait_for(server.disconnected.wait(), 5)  # closing reached the server
        await client.close()
    with refusing_address() as dead, pytest.raises(ConnectError):
        await pool().request(b"GET", f"http://{dead}", "/")


async def test_read_timeout_is_silence_not_a_total():
    """Bytes keep coming, each well within the timeout, for longer than the timeout in all."""
    body = b"0123456789"
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n" + body
    async with RawServer([reply], step=4, pause=0.1) as server:
        client = pool(read_timeout=0.4)
        response = await client.request(b"GET", server.url, "/")
        assert await response.read() == body  # ~1.2 s in all
        response.release()
        await client.close()


async def test_response_cut_short_closes_the_connection():
    async with RawServer([CHUNKED[:-5]]) as server:  # the stream never ends
        client = pool()
        response = await client.request(b"POST", server.url, "/", b"", b"{}")
        assert (await response.read_chunk()).startswith(b"data: one\n\n")  # what has arrived
        response.close()
        await asyncio.wait_for(server.disconnected.wait(), 5)
        assert not any(client._idle.values())
        await client.close()


async def test_large_body_read_whole_is_not_stalled_by_flow_control():
    body = b"x" * (3 << 20)  # beyond the 1 MiB point where reading from the engine pauses
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    async with RawServer([reply]) as server:
        client = pool(read_timeout=2.0)
        response = await client.request(b"GET", server.url, "/")
        assert await response.read() == body
        response.release()
        await client.close()


@pytest.mark.parametrize(
    ("reply", "connections"),
    [
        (JSON, 1),  # HTTP/1.1, complete: kept alive
        (
            JSON.replace(b"HTTP/1.1", b"HTTP/1.0").replace(
                b"\r\n\r\n", b"\r\nConnection: keep-alive\r\n\r\n"
            ),
            1,
        ),
        (JSON.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"), 2),
        (JSON.replace(b"HTTP/1.1", b"HTTP/1.0"), 2),  # 1.0 without keep-alive
        (JSON + b"junk", 2),  # bytes after the response: the answer stands, the connection goes
        (JSON + JSON, 2),  # two responses to one request
    ],
    ids=["1.1", "1.0-keep-alive", "connection-close", "1.0", "trailing-junk", "two-responses"],
)
async def test_connection_reused_only_when_complete_and_keep_alive(reply, connections):
    async with RawServer([reply, reply]) as server:
        client = pool()
        for path in ("/a", "/b"):
            response = await client.request(b"GET", server.url, path)
            assert response.status == 200 and await response.read() == b'{"ok": true}'
            response.release()
        assert server.connections == connections
        await client.close()


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nnot all",
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nConnection: close\r\n\r\nnot all",
        CHUNKED[:-5],
        CHUNKED.replace(b"chunked", b"gzip, chunked")[:-5],
    ],
    ids=["content-length", "content-length-connection-close", "chunked", "gzip-chunked"],
)
async def test_body_cut_by_the_engine_closing_is_an_error_not_an_end(reply):
    async with RawServer([reply], close_after=True) as server:
        client = pool()
        response = await client.request(b"GET", server.url, "/")
        with pytest.raises(ConnectionError):
            await response.read()
        response.close()
        await client.close()


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (b"HTTP/1.1 200 OK\r\nbad header line\r\n\r\n", "bad response head"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: twelve\r\n\r\n", "bad response head"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", "bad response"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * (70 * 1024), "larger than 64 KiB"),
    ],
    ids=["header-line", "content-length", "two-lengths", "huge-head"],
)
async def test_malformed_head_is_a_protocol_error(reply, message):
    async with RawServer([reply]) as server:
        client = pool()
        with pytest.raises(ProtocolError, match=message):
            await client.request(b"GET", server.url, "/")
        await client.close()


async def test_malformed_chunk_is_a_protocol_error_mid_stream():
    reply = CHUNKED.replace(b"B;ext=1\r\n", b"zz\r\n")
    async with RawServer([reply], step=5) as server:
        client = pool()
        pieces = []
        # Raised by read_chunk, or by request if the bad chunk came with the head.
        with pytest.raises(ProtocolError, match="bad response body"):
            response = await client.request(b"POST", server.url, "/", b"", b"{}")
            try:
                while chunk := await response.read_chunk():
                    pieces.append(chunk)
            finally:
                response.close()
        assert b"data: one\n\n".startswith(b"".join(pieces))
        await asyncio.wait_for(server.disconnected.wait(), 5)
        assert not any(client._idle.values())
        await client.close()
