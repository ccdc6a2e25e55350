"""The frontend's HTTP server: OpenAI endpoints that forward to the engines a request names.

Per generation request: read the body (capped), merge routing headers into `nvext`, let the
mode's picker choose discovered workers, run the prefill leg when the route is disaggregated,
then send the decode leg and pass its answer through — byte for byte, chunk by chunk for SSE,
parsed only when the client asked for response `nvext` fields. A client that goes away cancels
the handler (aiohttp handler cancellation), which closes the engine connection of whichever leg
is running, so the engine frees the request.
"""

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from dynamograph.epp.discovery import Discovery, WorkerRecord
from dynamograph.protocol.engine import Role
from dynamograph.protocol.headers import parse_routing_headers
from dynamograph.protocol.nvext import NvExt, NvExtError, parse_nvext
from dynamograph.protocol.openai import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    MODELS,
    OpenAIError,
    parse_json_body,
)

from . import nvext_out
from .directory import WorkerDirectory
from .handoff import (
    HandoffError,
    decode_request,
    prefill_request,
    reject_client_transfer_params,
    transfer_params,
)
from .http1 import Response
from .metrics import CONTENT_TYPE, FrontendMetrics
from .pickers import DirectPicker, Picker, RoundRobinPicker, Route
from .routing import Mode, merge
from .upstream import EngineClient, UpstreamError, describe

log = logging.getLogger(__name__)

JSON = "application/json"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# Engine response headers worth keeping: the request id and which worker / rank served it.
PASSED_RESPONSE_HEADERS = ("x-request-id", "x-dynamograph-worker-id", "x-dynamograph-dp-rank")
DEFAULT_MAX_BODY_BYTES = 10 * 1024 * 1024


@dataclass(slots=True)
class FrontendConfig:
    engine_url: str | None = None  # this pod's engine; None for a standalone kv/round-robin
    mode: Mode = Mode.DIRECT
    enforce_disagg: bool = False
    disagg_fallback: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_timeout: float = 600.0
    connect_timeout: float = 5.0
    kv_events: bool = True  # kv mode: subscribe to the workers' KV events (else approximate)
    router: Any = None  # kv mode: an epp.config.RouterConfig (None: its defaults)


def _outcome(status: int) -> str:
    if status < 400:
        return "ok"
    if status == 504:
        return "timeout"
    if status == 503:
        return "unavailable"
    if status >= 500:
        return "upstream_error"
    return "client_error"


def _error(exc: OpenAIError) -> web.Response:
    retry_after = getattr(exc, "retry_after", None)  # kv mode sheds load with 429
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after else None
    return web.Response(body=exc.json(), status=exc.status, content_type=JSON, headers=headers)


def _engine_message(raw: bytes) -> str:
    """The message inside an engine's OpenAI error body, else the body's start."""
    try:
        message = orjson.loads(raw)["error"]["message"]
        if isinstance(message, str):
            return message
    except (orjson.JSONDecodeError, KeyError, TypeError):
        pass
    return raw[:200].decode(errors="replace")


class Frontend:
    """One frontend process (or, in tests, one of several in a process). Use as
    `async with Frontend(config, discovery) as fe:` or start()/stop(); `fe.url` once started."""

    def __init__(self, config: FrontendConfig, graph: Discovery | None = None):
        self.config = config
        self.metrics = FrontendMetrics()
        self.directory = WorkerDirectory(config.engine_url, graph)
        self.client = EngineClient(
            request_timeout=config.request_timeout, connect_timeout=config.connect_timeout
        )
        self.picker: Picker = self._picker()
        self.app = self._app()
        self._runner: web.AppRunner | None = None
        self.url: str | None = None

    def _picker(self) -> Picker:
        cfg = self.config
        if cfg.mode is Mode.DIRECT:
            return DirectPicker(self.directory, enforce_disagg=cfg.enforce_disagg)
        if cfg.mode is Mode.ROUND_ROBIN:
            return RoundRobinPicker(self.directory, enforce_disagg=cfg.enforce_disagg)
        from .kv_mode import KvPicker  # the router core is paid for only in kv mode

        return KvPicker(
            self.directory,
            enforce_disagg=cfg.enforce_disagg,
            kv_events=cfg.kv_events,
            config=cfg.router,
        )

    def _app(self) -> web.Application:
        # The body cap is enforced by our own reader (with an OpenAI error); aiohttp's limit
        # is set just above it as a backstop for chunked bodies.
        app = web.Application(client_max_size=self.config.max_body_bytes + 1)
        app.router.add_post(CHAT_COMPLETIONS, self.generate)
        app.router.add_post(COMPLETIONS, self.generate)
        app.router.add_get(MODELS, self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/live", self.live)
        app.router.add_get("/metrics", self.metrics_page)
        return app

    # -- lifecycle --
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        await self.client.start()
        await self.directory.start()
        await self.picker.start()
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0][1]
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{bound}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.picker.stop()
        await self.directory.stop()
        await self.client.stop()

    async def __aenter__(self) -> "Frontend":
        if self.url is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- small endpoints --
    async def health(self, request: web.Request) -> web.Response:
        local = self.directory.local_record
        body: dict[str, Any] = {
            "status": "ok" if self.directory.ready() else "not ready",
            "mode": self.config.mode.value,
            "instance_id": local.instance_id if local else None,
            "workers": len(self.directory.records()),
        }
        reason = self.directory.not_ready()
        if reason is not None:
            body["reason"] = reason
        return web.json_response(body, status=503 if reason else 200)

    async def live(self, request: web.Request) -> web.Response:
        """Liveness: the process answers. Unlike /health it does not wait for the engine, so a
        slow model load does not get the sidecar restarted."""
        return web.json_response({"status": "alive"})

    async def metrics_page(self, request: web.Request) -> web.Response:
        for role in Role:
            self.metrics.workers.labels(role.value).set(len(self.directory.with_roles([role])))
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        """The local engine's list as it gives it; standalone, the graph's served models."""
        local = self.directory.local_record
        if local is not None:
            try:
                response = await self.client.get(local, MODELS, "local")
            except UpstreamError as exc:
                return _error(exc)
            return web.Response(body=response[1], status=response[0], content_type=JSON)
        names = sorted({r.config.served_model_name for r in self.directory.records()})
        data = [{"id": n, "object": "model", "owned_by": "dynamograph"} for n in names]
        return web.json_response({"object": "list", "data": data})

    # -- generation --
    async def _read_body(self, request: web.Request) -> bytes:
        cap = self.config.max_body_bytes
        too_large = f"request body is over the frontend's limit of {cap} bytes (--max-body-bytes)"
        if request.content_length is not None and request.content_length > cap:
            raise OpenAIError(
                413, too_large.replace("is over", f"of {request.content_length} B is over")
            )
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise OpenAIError(413, too_large) from None
        if len(raw) > cap:
            raise OpenAIError(413, too_large)
        return raw

    async def generate(self, request: web.Request) -> web.StreamResponse:
        trace = nvext_out.Trace.begin()
        metrics = self.metrics
        mode = self.config.mode.value
        stream = False
        disagg = "false"
        outcome = "ok"
        route: Route | None = None
        metrics.inflight.inc()
        try:
            raw = await self._read_body(request)
            body = parse_json_body(raw)
            try:
                nvext = parse_nvext(body.get("nvext"))
            except NvExtError as exc:
                raise OpenAIError(400, str(exc), param="nvext") from None
            nvext, pins = merge(nvext, parse_routing_headers(request.headers))
            reject_client_transfer_params(body)
            stream = body.get("stream") is True
            route = await self.picker.pick(pins, nvext, request.path, body)
            trace.decode = route.decode_target
            payload = raw
            if route.prefill is not None:
                disagg = "true"
                params = await self._prefill(request, route, body, trace)
                if params is not None:
                    payload = orjson.dumps(decode_request(body, params))
                else:
                    disagg = "fallback"
            response = await self._decode(request, route, payload, nvext, trace, stream)
            outcome = _outcome(trace.stream_error or response.status)
            return response
        except OpenAIError as exc:
            outcome = _outcome(exc.status)
            if isinstance(exc, UpstreamError):
                log.warning("%s", exc.message)
            return _error(exc)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except _ClientGone as gone:
            outcome = "cancelled"
            return gone.response
        except Exception as exc:  # a bug: answer in OpenAI's shape and count it, not a bare 500
            outcome = "error"
            log.exception("frontend failed on %s", request.path)
            return _error(OpenAIError(500, f"frontend error: {type(exc).__name__}: {exc}"))
        finally:
            metrics.inflight.dec()
            metrics.finished(mode, outcome, disagg, stream, trace.elapsed())
            if route is not None and route.booking is not None:
                route.booking.free()

    def _headers(self, request: web.Request, dp_rank: int | None) -> bytes:
        return EngineClient.headers(request.headers, dp_rank)

    def _upstream_failed(self, exc: UpstreamError, record: WorkerRecord, leg: str) -> None:
        self.metrics.upstream_errors.labels(leg, exc.kind).inc()
        if exc.kind == "connect":
            self.directory.mark_unreachable(record.instance_id)

    async def _prefill(
        self, request: web.Request, route: Route, body: dict[str, Any], trace: nvext_out.Trace
    ) -> dict[str, Any] | None:
        """Run the prefill leg; its `kv_transfer_params`, or None to serve aggregated instead."""
        assert route.prefill is not None and route.prefill_target is not None
        record = route.prefill
        started = time.perf_counter()
        trace.prefill = route.prefill_target
        try:
            status, raw = await self._call(
                record,
                request.path,
                orjson.dumps(prefill_request(body)),
                self._headers(request, route.prefill_target.dp_rank),
                "prefill",
            )
            where = describe(record, "prefill")
            if 400 <= status < 500:
                # The engine judged the request itself bad: aggregated would refuse it too.
                raise OpenAIError(status, f"{where} refused the request: {_engine_message(raw)}")
            if status >= 500:
                raise UpstreamError(
                    502, f"{where} failed with {status}: {_engine_message(raw)}", "status"
                )
            try:
                params = transfer_params(orjson.loads(raw))
            except (HandoffError, orjson.JSONDecodeError) as exc:
                raise UpstreamError(502, f"{where}: {exc}", "handoff") from None
            return params
        except UpstreamError as exc:
            self._upstream_failed(exc, record, "prefill")
            if not self.config.disagg_fallback:
                raise
            log.warning("%s; serving aggregated on the decode worker (--disagg-fallback)", exc)
            self.metrics.fallbacks.inc()
            trace.prefill = None
            return None
        finally:
            trace.prefill_s = time.perf_counter() - started
            self.metrics.prefill.observe(trace.prefill_s)
            if route.booking is not None:
                route.booking.mark_prefill_done()

    async def _call(
        self, record: WorkerRecord, path: str, payload: bytes, headers: bytes, leg: str
    ) -> tuple[int, bytes]:
        """A whole (non-streaming) engine call: status and body."""
        response = await self.client.open(record, path, payload, headers, leg)
        try:
            raw = await self.client.read(response, record, leg)
        finally:
            _finish(response)
        return response.status, raw

    async def _decode(
        self,
        request: web.Request,
        route: Route,
        payload: bytes,
        nvext: NvExt | None,
        trace: nvext_out.Trace,
        stream: bool,
    ) -> web.StreamResponse:
        record = route.decode
        headers = self._headers(request, route.decode_target.dp_rank)
        want_ext = nvext_out.wanted(nvext)
        try:
            upstream = await self.client.open(record, request.path, payload, headers, "decode")
        except UpstreamError as exc:
            self._upstream_failed(exc, record, "decode")
            raise
        try:
            trace.first_token_s = trace.elapsed()
            is_sse = upstream.content_type == "text/event-stream"
            if not (stream and is_sse and upstream.status == 200):
                try:
                    raw = await self.client.read(upstream, record, "decode")
                except UpstreamError as exc:
                    self._upstream_failed(exc, record, "decode")
                    raise
                if want_ext and upstream.status == 200:
                    raw = nvext_out.add_to_body(raw, self._ext(nvext, trace))
                self._first_byte(route, stream, trace)
                headers = _passed_headers(upstream)
                headers["Content-Type"] = upstream.headers.get("content-type", JSON)
                return web.Response(body=raw, status=upstream.status, headers=headers)
            return await self._relay(request, upstream, route, nvext, trace, want_ext)
        finally:
            _finish(upstream)

    def _ext(self, nvext: NvExt | None, trace: nvext_out.Trace):
        assert nvext is not None
        return lambda usage: nvext_out.response_nvext(nvext, trace, usage)

    def _first_byte(self, route: Route, stream: bool, trace: nvext_out.Trace) -> None:
        if route.booking is not None:
            route.booking.mark_prefill_done()
        self.metrics.first_byte(
            self.config.mode.value, stream, trace.first_token_s or trace.elapsed()
        )

    async def _relay(
        self,
        request: web.Request,
        upstream: Response,
        route: Route,
        nvext: NvExt | None,
        trace: nvext_out.Trace,
        want_ext: bool,
    ) -> web.StreamResponse:
        """SSE pass-through, chunk by chunk; the final chunk gains `nvext` when asked."""
        record = route.decode
        injector = nvext_out.FinalChunkInjector(self._ext(nvext, trace)) if want_ext else None
        response = web.StreamResponse(status=200, headers=SSE_HEADERS | _passed_headers(upstream))
        await response.prepare(request)
        first = True
        while True:
            try:
                chunk = await self.client.read_chunk(upstream, record, "decode")
            except UpstreamError as exc:
                # Headers are sent: report in-stream, as vLLM does, and end the stream.
                self._upstream_failed(exc, record, "decode")
                log.warning("%s", exc.message)
                trace.stream_error = exc.status
                await self._write(response, b"data: " + exc.json() + b"\n\n")
                break
            if not chunk:
                break
            if first:
                first = False
                trace.first_token_s = trace.elapsed()
                self._first_byte(route, True, trace)
            if injector is not None:
                chunk = injector.feed(chunk)
                if not chunk:
                    continue
            await self._write(response, chunk)
        if injector is not None:
            tail = injector.close()
            if tail:
                await self._write(response, tail)
        await self._write_eof(response)
        return response

    @staticmethod
    async def _write(response: web.StreamResponse, data: bytes) -> None:
        try:
            await response.write(data)
        except ConnectionError as exc:  # aiohttp's ClientConnectionResetError is one
            raise _ClientGone(response) from exc

    @staticmethod
    async def _write_eof(response: web.StreamResponse) -> None:
        try:
            await response.write_eof()
        except ConnectionError as exc:
            raise _ClientGone(response) from exc


class _ClientGone(Exception):
    """The client closed its connection while we were writing to it."""

    def __init__(self, response: web.StreamResponse):
        super().__init__("client disconnected")
        self.response = response


def _passed_headers(upstream: Response) -> dict[str, str]:
    found = upstream.headers
    return {name: found[name] for name in PASSED_RESPONSE_HEADERS if name in found}


def _finish(response: Response) -> None:
    """Pool the connection of a fully read response; close one cut short, so that the engine
    sees the disconnect and frees the request."""
    if response.is_eof():
        response.release()
    else:
        response.close()
