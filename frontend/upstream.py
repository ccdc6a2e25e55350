"""Calls to engines over the lean HTTP/1.1 pool (`http1`), engine failures mapped to OpenAI errors.

Keep-alive connections to every engine. Timeouts: `request_timeout` is the longest the engine
may stay silent (no response byte) before the call fails with 504; `first_byte_timeout` bounds
the wait for the response head (504 too: a hung engine is given up on sooner than a slow
stream); `connect_timeout` bounds opening a connection. A call that ends early (client gone, task cancelled) closes its
connection, so the engine sees the disconnect and frees the request.
"""

import asyncio
from collections.abc import Mapping

from dynamograph.protocol.headers import VLLM_DP_RANK
from dynamograph.protocol.http1 import ConnectError, Http1Pool, Response
from dynamograph.protocol.openai import OpenAIError
from dynamograph.router.discovery import WorkerRecord

# Client headers an engine may need (auth for `vllm serve --api-key`, tracing); nothing else
# of the client's reaches the engine, routing headers least of all.
FORWARDED_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate")
_JSON_HEADER = b"Content-Type: application/json\r\n"
_DP_RANK_HEADER = VLLM_DP_RANK.encode()


class UpstreamError(OpenAIError):
    """An engine call failed; `kind` (connect, timeout, disconnect, status, handoff) for metrics."""

    def __init__(self, status: int, message: str, kind: str):
        super().__init__(status, message)
        self.kind = kind


def describe(record: WorkerRecord, leg: str) -> str:
    return f"{leg} worker {record.name} ({record.instance_id}) at {record.engine_url}"


class EngineClient:
    def __init__(
        self,
        *,
        request_timeout: float,
        connect_timeout: float = 5.0,
        first_byte_timeout: float | None = None,
    ):
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.first_byte_timeout = first_byte_timeout
        self._pool: Http1Pool | None = None

    async def start(self) -> None:
        self._pool = Http1Pool(
            connect_timeout=self.connect_timeout, read_timeout=self.request_timeout
        )

    async def stop(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    @staticmethod
    def headers(client_headers: Mapping[str, str], dp_rank: int | None) -> bytes:
        """The engine request's header lines: JSON body, the client's forwardable headers (as
        the server hands them over: bytes read as latin-1, so they go out unchanged), and vLLM's
        DP rank selector."""
        out = _JSON_HEADER
        for name in FORWARDED_HEADERS:
            value = client_headers.get(name)
            if value is not None and "\r" not in value and "\n" not in value:
                out += b"%s: %s\r\n" % (name.encode(), value.encode("latin-1"))
        if dp_rank is not None:
            out += b"%s: %d\r\n" % (_DP_RANK_HEADER, dp_rank)
        return out

    async def open(
        self, record: WorkerRecord, path: str, payload: bytes, headers: bytes, leg: str
    ) -> Response:
        """POST and wait for the response head; the caller reads the body and closes it."""
        assert self._pool is not None, "EngineClient.start() first"
        waited = asyncio.timeout(self.first_byte_timeout)
        try:
            async with waited:  # cancelling the request closes its connection: the engine aborts
                return await self._pool.request(b"POST", record.engine_url, path, headers, payload)
        except (ConnectionError, TimeoutError) as exc:
            if waited.expired():
                raise UpstreamError(
                    504,
                    f"{describe(record, leg)} sent no response head within "
                    f"{self.first_byte_timeout:g} s (--first-byte-timeout)",
                    "first_byte",
                ) from exc
            raise self.failure(exc, record, leg) from exc

    async def read(self, response: Response, record: WorkerRecord, leg: str) -> bytes:
        try:
            return await response.read()
        except (ConnectionError, TimeoutError) as exc:
            raise self.failure(exc, record, leg) from exc

    async def read_chunk(self, response: Response, record: WorkerRecord, leg: str) -> bytes:
        try:
            return await response.read_chunk()
        except (ConnectionError, TimeoutError) as exc:
            raise self.failure(exc, record, leg) from exc

    async def get(self, record: WorkerRecord, path: str, leg: str) -> tuple[int, bytes]:
        assert self._pool is not None, "EngineClient.start() first"
        response = None
        try:
            response = await self._pool.request(b"GET", record.engine_url, path)
            return response.status, await response.read()
        except (ConnectionError, TimeoutError) as exc:
            raise self.failure(exc, record, leg) from exc
        finally:
            if response is not None:
                response.release()

    def failure(self, exc: Exception, record: WorkerRecord, leg: str) -> UpstreamError:
        """The UpstreamError for an engine-side failure (connection, timeout, broken stream)."""
        where = describe(record, leg)
        if isinstance(exc, ConnectError):
            return UpstreamError(502, f"{where} is unreachable: {exc}", "connect")
        if isinstance(exc, TimeoutError):
            return UpstreamError(
                504,
                f"{where} sent nothing for {self.request_timeout:g} s (--request-timeout)",
                "timeout",
            )
        return UpstreamError(
            502, f"{where} broke the connection: {type(exc).__name__}: {exc}", "disconnect"
        )
