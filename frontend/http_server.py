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

A request it cannot serve gets a plain-text answer and the connection closed, never silence:
400 bad syntax (request line, header, framing, chunked coding; an HTTP/1.1 request without one
Host), 408 a head not complete within `head_timeout` of its first byte or a body not complete
within `body_timeout` of its head (slow-loris, slow uploads), 414 a request line, 431 a head
over `MAX_HEAD` or with over `MAX_HEADERS` fields, 501 a method outside `methods` (CONNECT, TRACE, …) or a transfer-coding other
than chunked, 505 an HTTP version other than 1.0/1.1 (HTTP/2 prior knowledge included). 413 is
the handler's (`Exchange.body` with its cap). The timeouts are checked by the idle sweep, not
a timer per request.
"""

import asyncio
import contextlib
import logging
import re
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
MAX_HEADERS = 256  # header fields in a request head (Envoy forwards at most 100)
HEAD_TIMEOUT_S = 30.0  # a request head must be complete this long after its first byte
BODY_TIMEOUT_S = 120.0  # a request body must be complete this long after its head
METHODS = frozenset({"GET", "HEAD", "POST"})  # others are 501
_SWEEP_S = 5.0  # how often idle connections (and head/body deadlines) are looked at
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
    """The client disconnected before its request body arrived (or was cut off: a malformed
    or late body gets its 400/408 from the server, which closes the connection)."""


class _Refused(Exception):
    """Raised from a parser callback: the request gets `status` and the connection closes."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _parser_error_status(exc: Exception, data: bytes) -> int:
    if isinstance(exc, httptools.HttpParserInvalidMethodError):
        # A well-formed request line with a method llhttp does not know: not implemented for
        # any resource (501); anything else is not HTTP (400).
        line = data.split(b"\r\n", 1)[0].split(b" ")
        well_formed = len(line) == 3 and line[2][:5] == b"HTTP/" and _TOKEN.fullmatch(line[0])
        return 501 if well_formed else 400
    if "HTTP version" in str(exc) or "PRI/Upgrade" in str(exc):
        return 505  # HTTP/1.2, or HTTP/2 with prior knowledge (its PRI preface)
    return 400


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
        """The whole request body; BodyTooLarge past `cap` bytes, declared or counted (the
        connection then closes after the answer: the rest of the body is not read)."""
        declared = self.headers.get("content-length")
        length = int(declared) if declared is not None and declared.isdigit() else None
        if length is not None and length > cap:
            self.keep_alive = False
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
                    self.keep_alive = False
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
        self._parsed = 0
        self._in_head = False
        self._head_size = 0
        self._reading_paused = False
        self._writing_paused = False
        self._drain: asyncio.Future | None = None
        # Loop time by which the request head or body under way must be complete (None: not
        # receiving one), and what to answer if it is not; checked by the server's sweep.
        self.deadline: float | None = None
        self._late_body = False  # whether the deadline is the body's (else the head's)

    # -- asyncio.Protocol --
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            refused = exc.__context__
            if not isinstance(refused, _Refused):
                raise
            self._bad_request(refused.status, refused.message.encode())
        except httptools.HttpParserUpgrade:
            # A protocol switch (websocket, h2c) is not offered: a complete request is served
            # over HTTP/1.1 and the connection closed after it; anything else is refused.
            exchange = self._current or self._parsing
            if exchange is not None and exchange._body_done:
                exchange.keep_alive = False
            else:
                self._bad_request(400, b"protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            message = f"Invalid HTTP request received: {exc}".encode()
            self._bad_request(_parser_error_status(exc, data), message)
        else:
            # A head still incomplete after this read counts it (a body in the same read as
            # a complete head does not).
            if self._in_head:
                self._head_size += len(data)
                if self._head_size > MAX_HEAD:
                    if self._headers or self.parser.get_method():  # a header began
                        self._bad_request(431, b"request head over 64 KiB")
                    else:
                        self._bad_request(414, b"request line over 64 KiB")

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
        self._parsed = 0  # bytes of header fields parsed
        self.deadline = self.loop.time() + self.server.head_timeout
        self._late_body = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_HEAD:  # (a head that came in one read is counted here)
            raise _Refused(414, "request line over 64 KiB")

    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self._headers
        headers.append((name.decode("latin-1"), value.decode("latin-1")))
        self._parsed += len(name) + len(value) + 4
        if self._parsed > MAX_HEAD or len(headers) > MAX_HEADERS:
            raise _Refused(431, f"request head over 64 KiB or {MAX_HEADERS} header fields")

    def on_headers_complete(self) -> None:
        parser = self.parser
        self._in_head = False
        headers = CIMultiDict(self._headers)
        self._check_head(headers)
        self.deadline = self.loop.time() + self.server.body_timeout
        self._late_body = True
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
        self.deadline = None
        exchange, self._parsing = self._parsing, None
        if exchange is not None:
            exchange._body_done = True
            exchange._wake()

    def _check_head(self, headers: CIMultiDict) -> None:
        """What llhttp lets through and this server does not serve (raised as `_Refused`)."""
        parser = self.parser
        method = parser.get_method().decode("ascii", "replace")
        if method not in self.server.methods:
            raise _Refused(501, f"method {method} is not implemented")
        version = parser.get_http_version()
        if version not in ("1.1", "1.0"):
            raise _Refused(505, f"HTTP/{version} is not supported (HTTP/1.1 is)")
        if version == "1.1" and len(headers.getall("host", ())) != 1:
            raise _Refused(400, "an HTTP/1.1 request needs exactly one Host header")
        codings = headers.getall("transfer-encoding", ())
        if codings:  # llhttp has checked that chunked is the last coding
            names = {c.strip().lower() for v in codings for c in v.split(",")}
            if names != {"chunked"}:
                listed = ", ".join(sorted(names - {"chunked"}))
                raise _Refused(501, f"transfer-coding {listed} is not implemented")

    def expire(self, now: float) -> None:
        """The request head or body under way is late: 408 (see `HttpServer._sweep_idle`).
        A pipelined head waits while an earlier request is answered: its 408 comes after
        that answer, which it must not cut short."""
        if self._current is not None and self._current is not self._parsing:
            return
        if self.deadline is not None and now >= self.deadline:
            self.deadline = None
            server = self.server
            late = (
                f"request body not complete within {server.body_timeout:g} s"
                if self._late_body
                else f"request head not complete within {server.head_timeout:g} s"
            )
            self._bad_request(408, late.encode())

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
            if self.deadline is not None and self._late_body:
                # Reading was paused while the request waited: its body's time starts now.
                self.deadline = self.loop.time() + self.server.body_timeout
            return
        self.idle_since = self.loop.time()
        if self.server.stopping:
            self.close()

    def _bad_request(self, status: int, message: bytes) -> None:
        """Not HTTP/1.1 we can serve: a plain-text answer (unless an earlier request's answer
        is under way: it would be taken for that one's) and the connection closed. The
        request whose body was arriving, if any, ends as a disconnect (`ClientGone`)."""
        current = self._current
        if not self.closed and (
            current is None or (current is self._parsing and not current.started)
        ):
            phrase = _REASONS.get(status, b"")
            self.write(_BAD_REQUEST % (status, phrase, len(message), message))
        self.close()
        self.closed = True  # nothing more goes out; `connection_lost` still cleans up
        self.deadline = None
        if current is not None and current is self._parsing:
            current._disconnected()

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

    def __init__(
        self,
        handler: Handler,
        *,
        head_timeout: float | None = None,
        body_timeout: float | None = None,
        methods: Iterable[str] = METHODS,
    ):
        self.handler = handler
        self.head_timeout = HEAD_TIMEOUT_S if head_timeout is None else head_timeout
        self.body_timeout = BODY_TIMEOUT_S if body_timeout is None else body_timeout
        self.methods = frozenset(methods)
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
        """Close connections idle for over `KEEP_ALIVE_S` and answer late heads and bodies
        with 408: one pass every few seconds (a quarter of the shortest timeout) rather than
        a timer armed and cancelled around every request."""
        every = min(_SWEEP_S, self.head_timeout / 4, self.body_timeout / 4)
        while True:
            await asyncio.sleep(every)
            now = self.loop.time()
            limit = now - KEEP_ALIVE_S
            for conn in list(self.connections):
                if conn.idle_since is not None and conn.idle_since < limit:
                    conn.close()
                elif conn.deadline is not None:
                    conn.expire(now)

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
