"""The frontend's HTTP/1.1 server: an asyncio protocol around httptools' request parser (llhttp).

The frontend answers six paths over keep-alive connections from Envoy; a general server spends
most of the hop's server-side time on generality it does not need. Measured at c=1 with an app
that answers at once (same client, same box, same run): this protocol ~30 µs a round trip and
~20 µs CPU; uvicorn (httptools, uvloop) ~85 µs / ~65 µs — ASGI message dicts, an Event and a
keep-alive timer per request, header regexes, and the head and body in two writes, so the
client wakes twice; granian (Rust/hyper) 90–140 µs / 85–120 µs, its requests crossing threads.

This module owns: listening on a socket we bind (port 0 works), one request at a time per
connection (pipelined requests wait their turn, reading paused), the request head (64 KiB cap)
and body (the handler's cap, `Expect: 100-continue` honoured), whole responses in one write,
streamed ones chunked with the head riding on the first chunk, flow control both ways, idle
connections closed after `KEEP_ALIVE_S`, and a client disconnect turned into cancellation of its
request's task (`Exchange.cancel_on_disconnect`): the connection's `connection_lost` is the
signal, so watching for it costs a request nothing. On stop: no new connections, idle ones
closed, requests in flight get `GRACEFUL_S` to finish, then are cancelled.
"""

import asyncio
import contextlib
import logging
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from http import HTTPStatus
from urllib.parse import unquote

import httptools
from multidict import CIMultiDict

log = logging.getLogger(__name__)

Headers = list[tuple[bytes, bytes]]
Handler = Callable[["Exchange"], Awaitable[None]]

KEEP_ALIVE_S = 75.0  # idle client connections (Envoy's pool) stay open this long
GRACEFUL_S = 60.0  # on stop, requests in flight get this long to finish
MAX_HEAD = 64 * 1024  # request line and headers; llhttp sets no limit
_SWEEP_S = 5.0  # how often idle connections are looked at
_READ_HIGH_WATER = 1 << 20  # unread request body that pauses reading from the client
_BAD_REQUEST = (
    b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


def _status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))


class BodyTooLarge(Exception):
    """The request body is over the cap; `length` when the client declared it."""

    def __init__(self, length: int | None):
        super().__init__("request body too large")
        self.length = length


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class Exchange:
    """One HTTP request and its response.

    `headers`: the request's headers (`get` is case-insensitive; the first of repeated names).
    Responses are either whole (`respond`) or streamed (`start`, `write`..., `end`); `started`
    says whether the response has begun (after that, errors can only go in-stream); `gone`
    that the client disconnected before the response was complete.
    """

    __slots__ = (
        "_body",
        "_body_done",
        "_body_size",
        "_body_waiter",
        "_complete",
        "_conn",
        "_continue",
        "_head",
        "_task",
        "gone",
        "headers",
        "keep_alive",
        "method",
        "path",
        "started",
    )

    def __init__(
        self,
        conn: "_Connection",
        method: str,
        path: str,
        headers: CIMultiDict,
        keep_alive: bool,
        expect_continue: bool,
    ):
        self._conn = conn
        self.method = method
        self.path = path
        self.headers = headers
        self.keep_alive = keep_alive
        self._continue = expect_continue  # a `100 Continue` is owed before the body comes
        self._body: list[bytes] = []
        self._body_size = 0  # bytes received and not yet taken by `body()`
        self._body_done = False
        self._body_waiter: asyncio.Future | None = None
        self._head: bytes | None = None  # a streamed response's head, sent with its first bytes
        self._task: asyncio.Task | None = None  # cancelled on disconnect once armed
        self._complete = False
        self.started = False
        self.gone = False

    # -- request --
    async def body(self, cap: int) -> bytes:
        """The whole request body; BodyTooLarge past `cap` bytes, declared or counted."""
        declared = self.headers.get("content-length")
        length = int(declared) if declared is not None and declared.isdigit() else None
        if length is not None and length > cap:
            raise BodyTooLarge(length)
        if self._continue:
            self._continue = False
            if not self._body_done and not self.gone:
                self._conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        parts: list[bytes] = []
        size = 0
        while True:
            if self._body:
                size += self._body_size
                if size > cap:
                    raise BodyTooLarge(length)
                parts += self._body
                self._body.clear()
                self._body_size = 0
                self._conn.resume_reading()
            if self._body_done:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            if self.gone:
                raise ClientGone()
            waiter = self._body_waiter = self._conn.loop.create_future()
            try:
                await waiter
            finally:
                self._body_waiter = None

    def _feed(self, data: bytes) -> None:
        self._body.append(data)
        self._body_size += len(data)
        if self._body_size > _READ_HIGH_WATER:
            self._conn.pause_reading()
        self._wake()

    def _wake(self) -> None:
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def cancel_on_disconnect(self) -> None:
        """From now until `done()`, a client disconnect cancels the calling task (which closes
        the engine connection it is waiting on). A client already gone cancels it at once."""
        self._task = task = asyncio.current_task(self._conn.loop)  # (no loop lookup: getpid)
        if self.gone and task is not None:
            task.cancel()

    def done(self) -> None:
        self._task = None

    def _disconnected(self) -> None:
        if self._complete:
            return
        self.gone = True
        self._wake()
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()

    # -- response --
    def _head_bytes(self, status: int, headers: Iterable[tuple[bytes, bytes]], framing: bytes):
        """Status line and headers. Header values come from this package or from an engine's
        response as parsed by llhttp, which refuses CR and LF in them, so none is checked."""
        parts = [_status_line(status)]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts.append(framing)
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    async def respond(
        self, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]]
    ) -> None:
        """A whole response: head and body in one write."""
        self.started = True
        head = self._head_bytes(status, headers, b"content-length: %d\r\n" % len(body))
        self._finish(head if self.method == "HEAD" else head + body)
        await self._conn.drain()

    async def start(self, status: int, headers: Headers) -> None:
        """Begin a streamed (chunked) response. The head goes out with the first `write`, so the
        client's first wake-up already has data."""
        self.started = True
        self._head = self._head_bytes(status, headers, b"transfer-encoding: chunked\r\n")

    async def write(self, data: bytes) -> None:
        if not data:
            return
        out = b"%x\r\n%s\r\n" % (len(data), data) if self.method != "HEAD" else b""
        head, self._head = self._head, None
        self._conn.write(head + out if head is not None else out)
        await self._conn.drain()

    async def end(self, data: bytes = b"") -> None:
        """End a streamed response; `data`, its last bytes, go out in the same write."""
        tail = b""
        if self.method != "HEAD":
            tail = b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n"
        head, self._head = self._head, None
        self._finish(head + tail if head is not None else tail)

    def _finish(self, data: bytes) -> None:
        self._complete = True
        self._conn.write(data)


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs them one at a time, writes their answers."""

    def __init__(self, server: "HttpServer"):
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.idle_since: float | None = self.loop.time()  # None while a request is in flight
        self._current: Exchange | None = None  # the request being answered
        self._parsing: Exchange | None = None  # the request whose body is arriving
        self._queued: deque[Exchange] = deque()  # pipelined requests waiting their turn
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._in_head = False
        self._head_size = 0
        self._reading_paused = False
        self._writing_paused = False
        self._drain: asyncio.Future | None = None

    # -- asyncio.Protocol --
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # A protocol switch (websocket, h2c) is not offered: a complete request is served
            # over HTTP/1.1 and the connection closed after it; anything else is refused.
            exchange = self._current or self._parsing
            if exchange is not None and exchange._body_done:
                exchange.keep_alive = False
            else:
                self._bad_request(400, b"protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._bad_request(400, f"Invalid HTTP request received: {exc}".encode())
        else:
            # A head still incomplete after this read counts it (a body in the same read as
            # a complete head does not).
            if self._in_head:
                self._head_size += len(data)
                if self._head_size > MAX_HEAD:
                    self._bad_request(431, b"request head over 64 KiB")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        for exchange in (self._current, self._parsing, *self._queued):
            if exchange is not None:
                exchange._disconnected()
        self._queued.clear()
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)

    def eof_received(self) -> None:
        return None  # a client that half-closes is gone: close (and cancel its request)

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)

    # -- httptools callbacks --
    def on_message_begin(self) -> None:
        self._in_head = True
        self._head_size = 0
        self._url = b""
        self._headers = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        parser = self.parser
        self._in_head = False
        headers = CIMultiDict(self._headers)
        path = httptools.parse_url(self._url).path.decode("latin-1")
        if "%" in path:
            path = unquote(path, "latin-1")
        expect = headers.get("expect")
        exchange = self._parsing = Exchange(
            self,
            parser.get_method().decode("ascii"),
            path,
            headers,
            parser.should_keep_alive() and not self.server.stopping,
            expect is not None and expect.lower() == "100-continue",
        )
        if self._current is None:
            self._begin(exchange)
        else:
            self._queued.append(exchange)
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        if self._parsing is not None:
            self._parsing._feed(body)

    def on_message_complete(self) -> None:
        exchange, self._parsing = self._parsing, None
        if exchange is not None:
            exchange._body_done = True
            exchange._wake()

    # -- running requests --
    def _begin(self, exchange: Exchange) -> None:
        self._current = exchange
        self.idle_since = None
        self.server.run(exchange)

    def finished(self, exchange: Exchange) -> None:
        """The handler of `exchange` returned (or failed): next request, idle, or close."""
        self._current = None
        if self.closed:
            return
        if not (exchange._complete and exchange._body_done and exchange.keep_alive):
            self.close()  # a cut-short answer, an unread body, or the client asked
            return
        if self._queued:
            self._begin(self._queued.popleft())
            if not self._queued:
                self.resume_reading()
            return
        self.idle_since = self.loop.time()
        if self.server.stopping:
            self.close()

    def _bad_request(self, status: int, message: bytes) -> None:
        """Not HTTP/1.1 we can serve: a plain-text answer (when no other is under way) and
        the connection closed."""
        if self._current is None and not self.closed:
            phrase = _REASONS.get(status, b"")
            self.write(_BAD_REQUEST % (status, phrase, len(message), message))
        self.close()

    # -- transport --
    def write(self, data: bytes) -> None:
        if not self.closed and data:
            assert self.transport is not None
            self.transport.write(data)

    async def drain(self) -> None:
        """Wait while the client is not taking what we wrote (transport over its high water)."""
        while self._writing_paused and not self.closed:
            self._drain = self.loop.create_future()
            try:
                await self._drain
            finally:
                self._drain = None

    def pause_reading(self) -> None:
        if not self._reading_paused and not self.closed and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and not self.closed and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def stop(self) -> None:
        """The server stops: close now if idle, else after the answer under way (which says
        `connection: close` unless its head has gone out already)."""
        if self._current is None:
            self.close()
        else:
            self._current.keep_alive = False


class HttpServer:
    """Serves `handler(exchange)` for every request, in the running event loop."""

    def __init__(self, handler: Handler):
        self.handler = handler
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # at start
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task] = set()
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port); the port bound."""
        self.loop = asyncio.get_running_loop()
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            self._server = await self.loop.create_server(
                lambda: _Connection(self), sock=sock, backlog=1024
            )
        except OSError:
            sock.close()
            raise
        self._sweeper = asyncio.create_task(self._sweep_idle())
        return sock.getsockname()[1]

    def run(self, exchange: Exchange) -> None:
        task = self.loop.create_task(self._run(exchange))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, exchange: Exchange) -> None:
        try:
            await self.handler(exchange)
            if not exchange.started and not exchange.gone:
                raise RuntimeError("the handler returned without answering")
        except Exception:
            log.exception("unhandled error serving %s %s", exchange.method, exchange.path)
            if not exchange.started:
                exchange.keep_alive = False
                with contextlib.suppress(Exception):
                    await exchange.respond(500, b"Internal Server Error", [])
        finally:
            exchange._conn.finished(exchange)

    async def _sweep_idle(self) -> None:
        """Close connections idle for over `KEEP_ALIVE_S`: one pass every few seconds rather
        than a timer armed and cancelled around every request."""
        while True:
            await asyncio.sleep(_SWEEP_S)
            limit = self.loop.time() - KEEP_ALIVE_S
            for conn in list(self.connections):
                if conn.idle_since is not None and conn.idle_since < limit:
                    conn.close()

    async def stop(self) -> None:
        if self._server is None:
            return
        self.stopping = True
        self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for conn in list(self.connections):
            conn.stop()
        if self.tasks:
            _, late = await asyncio.wait(set(self.tasks), timeout=GRACEFUL_S)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)
        for conn in list(self.connections):
            conn.close()
        self._server = None
        self.stopping = False
