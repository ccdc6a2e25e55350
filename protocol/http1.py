"""A lean keep-alive HTTP/1.1 client for calls to engines: the frontend's engine legs (its hot
path) and the EPP's `/metrics` scrapes. Shared by both, so it lives here, not in either.

aiohttp's ClientSession spends about half of the frontend's CPU per request on features an
engine hop never uses (cookies, redirects, proxies, tracing, multipart). This client does one
thing: POST/GET to a known `host:port` over pooled keep-alive connections, one write per request,
and hands back the response head, then the body as it arrives — whole, or chunk by chunk.
Response framing (status line, headers, content-length, chunked, close-delimited) is parsed by
httptools (llhttp, the parser uvicorn uses); this module owns the pool, timeouts and flow
control. Timeouts: `connect_timeout` to open a connection; `read_timeout` for any wait on the
engine (no byte for that long → TimeoutError), enforced by one sweep of the waiting responses
every `read_timeout / 4` (at most 1 s) rather than a timer armed and cancelled around every
wait — a streamed response waits once per chunk. A response not read to its end is closed, never
pooled, so the engine sees the disconnect; a connection is reused only when the parser saw the
message complete and says it may be kept alive.
"""

import asyncio
import contextlib
from collections import deque
from typing import cast
from urllib.parse import urlsplit

import httptools

_MAX_HEAD = 64 * 1024  # llhttp sets no limit on the response head; we do
_HIGH_WATER = 1 << 20  # pause reading from an engine whose output the client is not taking


class ProtocolError(ConnectionError):
    """The engine's answer is not well-formed HTTP/1.1."""


class ConnectError(ConnectionError):
    """No connection could be opened (refused, unresolvable, or not within the timeout)."""


class _Conn(asyncio.Protocol):
    """One connection; feeds the bytes of one response at a time to its `Response`."""

    def __init__(self, pool: "Http1Pool", key: tuple[str, int], loop: asyncio.AbstractEventLoop):
        self.pool = pool
        self.key = key
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.response: Response | None = None

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream connection's

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes while idle: the engine is not speaking HTTP to us
            self.close()
            return
        try:
            response._feed(data)
        except ProtocolError as exc:
            response._fail(exc)
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None:
            self.response._connection_lost(exc)

    # -- helpers --
    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """An engine's response: `status`, `headers` (lower-case names), then the body.

    It is its own httptools parser's callback object (the `on_*` methods); one parser per
    response, so a connection carries no parser state from one request to the next."""

    def __init__(self, conn: _Conn):
        self._conn = conn
        self._waiting_since = 0.0  # loop time the current wait began
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._head_size = 0
        self._began = False
        self._head_done = False
        self._eof = False  # message complete (or a close-delimited body's connection closed)
        self._keep_alive = False
        self.status = 0
        self.headers: dict[str, str] = {}

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";", 1)[0].strip().lower()

    def is_eof(self) -> bool:
        return self._eof

    # -- httptools callbacks --
    def on_message_begin(self) -> None:
        if self._began:  # a second message after ours: stop the parser (see `_feed`)
            raise ProtocolError("more than one response to one request")
        self._began = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._head_done:  # (trailers after a chunked body are dropped)
            self.headers[name.lower().decode("latin-1")] = value.strip().decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._head_done = True

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self._conn.transport:
            self._paused = True
            self._conn.transport.pause_reading()

    def on_message_complete(self) -> None:
        self._keep_alive = self._parser.should_keep_alive()
        self._eof = True

    # -- feeding (called from the protocol) --
    def _feed(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if not self._eof:
                raise ProtocolError(self._describe(exc, data)) from exc
            # Bytes after a complete response (or a switch of protocols): the answer stands,
            # the connection is not reused.
            self._keep_alive = False
        finally:
            self._wake()
        if not self._head_done:
            self._head_size += len(data)
            if self._head_size > _MAX_HEAD:
                raise ProtocolError("response head larger than 64 KiB")

    def _describe(self, exc: Exception, data: bytes) -> str:
        if not self._parser.get_status_code():
            line = data.split(b"\r\n", 1)[0][:80]
            return f"bad status line {line!r}: {exc}"
        return f"bad response {'body' if self._head_done else 'head'}: {exc}"

    def _close_delimited(self) -> bool:
        """Whether the body runs until the engine closes the connection: neither
        Content-Length nor a final chunked coding (RFC 9112 §6.3). llhttp knows this, but
        httptools exposes neither `llhttp_message_needs_eof` nor `llhttp_finish`, so the end
        of such a body — the connection closing — is recognised here."""
        if "content-length" in self.headers:
            return False
        codings = self.headers.get("transfer-encoding", "")
        return codings.rsplit(",", 1)[-1].strip().lower() != "chunked"

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._wake()

    def _connection_lost(self, exc: Exception | None) -> None:
        if not self._eof:
            if exc is None and self._head_done and self._close_delimited():
                self._eof = True
            else:
                self._error = exc or ConnectionResetError("engine closed the connection")
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        conn = self._conn
        waiter = self._waiter = conn.loop.create_future()
        # No timer per wait: the pool's sweep fails a wait that has lasted `read_timeout`.
        waiting = conn.pool._waiting
        if waiting is not None:
            self._waiting_since = conn.loop.time()
            waiting.add(self)
        try:
            await waiter
        finally:
            self._waiter = None
            if waiting is not None:
                waiting.discard(self)
        if self._error is not None:
            raise self._error

    def _expire(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(TimeoutError())

    # -- reading (called by the frontend) --
    async def _head(self) -> None:
        while not self._head_done:
            await self._wait()

    async def read_chunk(self) -> bytes:
        """The body bytes that have arrived and not been read, waiting for some when there are
        none; b"" at its end. Pieces that arrived while the reader was busy come joined, so a
        relay writes once for them rather than once per piece (an engine streaming fast
        delivers several SSE events per wake-up)."""
        chunks = self._chunks
        while not chunks:
            if self._eof:
                return b""
            await self._wait()
        if len(chunks) == 1:
            data = chunks.popleft()
        else:
            data = b"".join(chunks)
            chunks.clear()
        self._buffered -= len(data)
        if self._paused and self._buffered < _HIGH_WATER // 2:
            self._resume()
        return data

    async def read(self) -> bytes:
        """The whole body."""
        parts: list[bytes] = []
        while True:  # take what came, so flow control never stalls a body we are waiting for
            parts += self._chunks
            self._chunks.clear()
            self._buffered = 0
            if self._paused:
                self._resume()
            if self._eof:
                return b"".join(parts)
            await self._wait()

    def _resume(self) -> None:
        self._paused = False
        if self._conn.transport is not None:
            self._conn.transport.resume_reading()

    def release(self) -> None:
        """Done with the response: pool the connection if it is reusable, else close it."""
        conn = self._conn
        if conn.response is not self:
            return
        conn.response = None
        reusable = self._eof and self._keep_alive and not self._chunks
        if reusable and not conn.closed:
            conn.pool._put(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Abandon the response: close the connection (the engine sees the disconnect)."""
        conn = self._conn
        if conn.response is self:
            conn.response = None
        conn.close()


class Http1Pool:
    def __init__(self, *, connect_timeout: float | None, read_timeout: float | None):
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._addresses: dict[str, tuple[tuple[str, int], bytes]] = {}
        self._closed = False
        # Responses waiting on their engine, and the task that times them out (no timeout:
        # neither). The sweeper starts with the first connection, in the running loop.
        self._waiting: set[Response] | None = set() if read_timeout is not None else None
        self._sweeper: asyncio.Task[None] | None = None

    async def _sweep(self, limit_s: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, limit_s / 4))
            waiting = self._waiting
            if waiting:
                limit = loop.time() - limit_s
                for response in [r for r in waiting if r._waiting_since <= limit]:
                    response._expire()

    def address(self, base_url: str) -> tuple[tuple[str, int], bytes]:
        """(host, port) and the Host header value of an engine base URL (parsed once)."""
        found = self._addresses.get(base_url)
        if found is None:
            parts = urlsplit(base_url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"engine URL must be http://host:port, got {base_url!r}")
            port = parts.port or 80
            found = ((parts.hostname, port), parts.netloc.encode("ascii"))
            if len(self._addresses) > 4096:  # workers come and go: keep it bounded
                self._addresses.clear()
            self._addresses[base_url] = found
        return found

    async def request(
        self,
        method: bytes,
        base_url: str,
        path: str,
        headers: bytes = b"",
        body: bytes | None = None,
    ) -> Response:
        """Send a request and wait for the response head. `headers`: ready `Name: value\\r\\n`
        lines. A reused keep-alive connection the engine had already closed is retried once
        on a fresh one (the request cannot have been processed)."""
        key, host = self.address(base_url)
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\n%s" % (method, path.encode(), host, headers)
        if body is not None:
            head += b"Content-Length: %d\r\n" % len(body)
        message = head + b"\r\n" + (body or b"")
        while True:
            conn, reused = self._take(key), True
            if conn is None:
                conn, reused = await self._connect(key), False
            response = Response(conn)
            conn.response = response
            assert conn.transport is not None
            conn.transport.write(message)
            try:
                await response._head()
            except ConnectionError:
                response.close()
                if reused and not response._head_done:
                    continue  # stale pooled connection: once more on a new one
                raise
            except BaseException:
                response.close()
                raise
            return response

    def _take(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    def _put(self, conn: _Conn) -> None:
        if self._closed:
            conn.close()
        else:
            self._idle.setdefault(conn.key, []).append(conn)

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        loop = asyncio.get_running_loop()
        if self._sweeper is None and self.read_timeout is not None and not self._closed:
            self._sweeper = loop.create_task(self._sweep(self.read_timeout))
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: _Conn(self, key, loop), *key)
        except TimeoutError:
            raise ConnectError(f"no connection within {self.connect_timeout:g} s") from None
        except OSError as exc:
            raise ConnectError(exc.strerror or str(exc)) from exc
        return conn

    async def close(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
