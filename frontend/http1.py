"""A lean keep-alive HTTP/1.1 client for the frontend's engine calls (the hot path).

aiohttp's ClientSession spends about half of the frontend's CPU per request on features an
engine hop never uses (cookies, redirects, proxies, tracing, multipart). This client does one
thing: POST/GET to a known `host:port` over pooled keep-alive connections, one write per request,
and hands back the response head, then the body as it arrives — whole, or chunk by chunk
(content-length, chunked, or until close framing). Timeouts: `connect_timeout` to open a
connection; `read_timeout` for any wait on the engine (no byte for that long → TimeoutError).
A response not read to its end is closed, never pooled, so the engine sees the disconnect.
"""

import asyncio
from collections import deque
from urllib.parse import urlsplit

_HEAD_END = b"\r\n\r\n"
_MAX_HEAD = 64 * 1024
_HIGH_WATER = 1 << 20  # pause reading from an engine whose output the client is not taking


class ProtocolError(ConnectionError):
    """The engine's answer is not well-formed HTTP/1.1."""


class ConnectError(ConnectionError):
    """No connection could be opened (refused, unresolvable, or not within the timeout)."""


class _Conn(asyncio.Protocol):
    """One connection; parses one response at a time into `Response`."""

    def __init__(self, pool: "Http1Pool", key: tuple[str, int]):
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.response: Response | None = None
        self._buffer = bytearray()

    # -- asyncio.Protocol --
    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        response = self.response
        if response is None:  # bytes while idle: the engine is not speaking HTTP to us
            self.close()
            return
        try:
            response._parse(self._buffer)
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
    """An engine's response: `status`, `headers` (lower-case names), then the body."""

    def __init__(self, conn: _Conn, read_timeout: float | None):
        self._conn = conn
        self._read_timeout = read_timeout
        self._waiter: asyncio.Future | None = None
        self._error: BaseException | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._head_done = False
        self._eof = False
        self._keep_alive = True
        self._remaining = 0  # content-length framing: bytes still to come
        self._chunked = False
        self._chunk_left = -1  # chunked framing: bytes left in the current chunk; -1 = size line
        self._until_close = False
        self.status = 0
        self.headers: dict[str, str] = {}

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";", 1)[0].strip().lower()

    def is_eof(self) -> bool:
        return self._eof

    # -- parsing (called from the protocol) --
    def _parse(self, buffer: bytearray) -> None:
        if self._eof:
            return
        if not self._head_done:
            end = buffer.find(_HEAD_END)
            if end < 0:
                if len(buffer) > _MAX_HEAD:
                    raise ProtocolError("response head larger than 64 KiB")
                return
            self._parse_head(bytes(buffer[:end]))
            del buffer[: end + 4]
            self._head_done = True
        if self._until_close:
            self._push(bytes(buffer))
            buffer.clear()
        elif self._chunked:
            self._parse_chunked(buffer)
        else:
            take = min(self._remaining, len(buffer))
            if take:
                self._push(bytes(buffer[:take]))
                del buffer[:take]
                self._remaining -= take
            if self._remaining == 0:
                self._finish()
        self._wake()

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ProtocolError(f"bad status line {lines[0][:80]!r}")
        self.status = int(parts[1])
        headers = self.headers
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise ProtocolError(f"bad header line {line[:80]!r}")
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        connection = headers.get("connection", "").lower()
        self._keep_alive = connection != "close" and parts[0] == b"HTTP/1.1"
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._chunked = True
        elif "content-length" in headers:
            try:
                self._remaining = int(headers["content-length"])
            except ValueError:
                raise ProtocolError("bad content-length") from None
        elif self.status in (204, 304) or 100 <= self.status < 200:
            self._remaining = 0
        else:
            self._until_close = True
            self._keep_alive = False

    def _parse_chunked(self, buffer: bytearray) -> None:
        while not self._eof:
            if self._chunk_left == -1:  # a size line
                end = buffer.find(b"\r\n")
                if end < 0:
                    return
                size = buffer[:end].split(b";", 1)[0].strip()
                try:
                    self._chunk_left = int(size, 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size {bytes(size[:20])!r}") from None
                del buffer[: end + 2]
                if self._chunk_left == 0:
                    self._chunk_left = -2  # trailers follow
            if self._chunk_left == -2:  # trailers, up to the empty line
                end = buffer.find(b"\r\n")
                if end < 0:
                    return
                del buffer[: end + 2]
                if end == 0:
                    self._finish()
                continue
            if len(buffer) < self._chunk_left + 2:  # wait for the whole chunk and its CRLF
                if self._chunk_left and buffer:  # pass on what is there already
                    take = min(len(buffer), self._chunk_left)
                    self._push(bytes(buffer[:take]))
                    del buffer[:take]
                    self._chunk_left -= take
                return
            if self._chunk_left:
                self._push(bytes(buffer[: self._chunk_left]))
            if buffer[self._chunk_left : self._chunk_left + 2] != b"\r\n":
                raise ProtocolError("chunk not followed by CRLF")
            del buffer[: self._chunk_left + 2]
            self._chunk_left = -1

    def _push(self, data: bytes) -> None:
        if not data:
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER and not self._paused and self._conn.transport:
            self._paused = True
            self._conn.transport.pause_reading()

    def _finish(self) -> None:
        self._eof = True

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._wake()

    def _connection_lost(self, exc: Exception | None) -> None:
        if self._until_close and exc is None:
            self._finish()
        elif not self._eof:
            self._error = exc or ConnectionResetError("engine closed the connection")
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        try:
            async with asyncio.timeout(self._read_timeout):
                await self._waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    # -- reading (called by the frontend) --
    async def _head(self) -> None:
        while not self._head_done:
            await self._wait()

    async def read_chunk(self) -> bytes:
        """The next piece of the body as it arrived; b"" at its end."""
        while not self._chunks:
            if self._eof:
                return b""
            await self._wait()
        data = self._chunks.popleft()
        self._buffered -= len(data)
        if self._paused and self._buffered < _HIGH_WATER // 2 and self._conn.transport:
            self._paused = False
            self._conn.transport.resume_reading()
        return data

    async def read(self) -> bytes:
        """The whole body."""
        while not self._eof:
            await self._wait()
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        return data

    def release(self) -> None:
        """Done with the response: pool the connection if it is reusable, else close it."""
        conn = self._conn
        if conn.response is not self:
            return
        conn.response = None
        reusable = self._eof and self._keep_alive and not self._chunks and not conn._buffer
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
            response = Response(conn, self.read_timeout)
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
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: _Conn(self, key), *key)
        except TimeoutError:
            raise ConnectError(f"no connection within {self.connect_timeout:g} s") from None
        except OSError as exc:
            raise ConnectError(exc.strerror or str(exc)) from exc
        return conn

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
