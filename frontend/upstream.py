"""Calls to engines: one pooled aiohttp client, engine failures mapped to OpenAI errors.

Keep-alive connections to every engine, no per-request session. Timeouts: `request_timeout` is
the longest the engine may stay silent (no response byte) before the call fails with 504;
`connect_timeout` bounds opening a connection. A call that ends early (client gone, task
cancelled) closes its connection, so the engine sees the disconnect and frees the request.
"""

from collections.abc import Mapping

import aiohttp
from yarl import URL

from dynamograph.epp.discovery import WorkerRecord
from dynamograph.protocol.headers import VLLM_DP_RANK
from dynamograph.protocol.openai import OpenAIError

# Client headers an engine may need (auth for `vllm serve --api-key`, tracing); nothing else
# of the client's reaches the engine, routing headers least of all.
FORWARDED_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate")


class UpstreamError(OpenAIError):
    """An engine call failed; `kind` (connect, timeout, disconnect, status, handoff) for metrics."""

    def __init__(self, status: int, message: str, kind: str):
        super().__init__(status, message)
        self.kind = kind


def describe(record: WorkerRecord, leg: str) -> str:
    return f"{leg} worker {record.name} ({record.instance_id}) at {record.engine_url}"


class EngineClient:
    def __init__(self, *, request_timeout: float, connect_timeout: float = 5.0):
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[tuple[str, str], URL] = {}  # parsed once: yarl parsing is not free

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self.connect_timeout, sock_read=self.request_timeout
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _url(self, record: WorkerRecord, path: str) -> URL:
        key = (record.engine_url, path)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) > 4096:  # workers come and go: keep the cache bounded
                self._urls.clear()
            url = self._urls[key] = URL(record.engine_url + path)
        return url

    @staticmethod
    def headers(client_headers: Mapping[str, str], dp_rank: int | None) -> dict[str, str]:
        out = {"Content-Type": "application/json"}
        for name in FORWARDED_HEADERS:
            value = client_headers.get(name)
            if value is not None:
                out[name] = value
        if dp_rank is not None:
            out[VLLM_DP_RANK] = str(dp_rank)
        return out

    async def open(
        self,
        record: WorkerRecord,
        path: str,
        payload: bytes,
        headers: Mapping[str, str],
        leg: str,
    ) -> aiohttp.ClientResponse:
        """POST and wait for the response headers; the caller reads the body and closes it."""
        assert self._session is not None, "EngineClient.start() first"
        try:
            return await self._session.post(self._url(record, path), data=payload, headers=headers)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self.failure(exc, record, leg) from exc

    async def read(self, response: aiohttp.ClientResponse, record: WorkerRecord, leg: str) -> bytes:
        try:
            return await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self.failure(exc, record, leg) from exc

    async def read_chunk(
        self, response: aiohttp.ClientResponse, record: WorkerRecord, leg: str
    ) -> bytes:
        try:
            return await response.content.readany()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self.failure(exc, record, leg) from exc

    async def get(self, record: WorkerRecord, path: str, leg: str) -> tuple[int, bytes]:
        assert self._session is not None, "EngineClient.start() first"
        try:
            async with self._session.get(self._url(record, path)) as response:
                return response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self.failure(exc, record, leg) from exc

    def failure(self, exc: Exception, record: WorkerRecord, leg: str) -> UpstreamError:
        """The UpstreamError for an engine-side failure (connection, timeout, broken stream)."""
        where = describe(record, leg)
        if isinstance(exc, aiohttp.ClientConnectorError):
            return UpstreamError(502, f"{where} is unreachable: {exc.os_error}", "connect")
        if isinstance(exc, TimeoutError):
            return UpstreamError(
                504,
                f"{where} sent nothing for {self.request_timeout:g} s (--request-timeout)",
                "timeout",
            )
        return UpstreamError(
            502, f"{where} broke the connection: {type(exc).__name__}: {exc}", "disconnect"
        )
