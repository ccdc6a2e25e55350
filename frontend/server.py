"""The frontend's HTTP server: OpenAI endpoints that forward to the engines a request names.

Per generation request: read the body (capped), merge routing headers into `nvext`, let the
mode's picker choose discovered workers, run the prefill leg when the route is disaggregated,
then send the decode leg and pass its answer through — byte for byte, chunk by chunk for SSE,
parsed only when the client asked for response `nvext` fields. A client that goes away cancels
the request's task (`http_server.Exchange.cancel_on_disconnect`), which closes the decode
leg's engine connection, so the engine frees the request. A client that leaves during the
prefill leg does not cut it: as Dynamo, the prefill runs to its end and the decode leg is still
sent (one token, not streamed), so the decode engine pulls the KV the prefill holds for it and
both engines free it; the request's booking is freed after that (`_abandoned`). The HTTP server
is the package's own lean HTTP/1.1 protocol (`http_server.py`); no web framework sits in the
hop.
"""

import asyncio
import logging
import math
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import orjson

from dynamograph.protocol.engine import BOOTSTRAP_ROOM, Role, served_models
from dynamograph.protocol.http1 import Response
from dynamograph.protocol.nvext import NvExt, NvExtError, SessionAction, parse_nvext
from dynamograph.protocol.openai import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    MODELS,
    OpenAIError,
    parse_json_body,
)
from dynamograph.router.discovery import Discovery, WorkerRecord

from . import nvext_out, speculative
from .directory import WorkerDirectory
from .handoff import (
    KV_TRANSFER_PARAMS,
    HandoffError,
    bootstrap_params,
    bootstrap_room,
    decode_request,
    prefill_request,
    reject_client_transfer_params,
    transfer_params,
)
from .http_server import (
    BODY_TIMEOUT_S,
    HEAD_TIMEOUT_S,
    BodyTooLarge,
    ClientGone,
    Exchange,
    Headers,
    HttpServer,
)
from .metrics import CONTENT_TYPE, FrontendMetrics
from .modes import DirectMode, RoundRobinMode, Route, RoutingMode
from .routing import Mode, Pins, merge, routing_headers
from .upstream import EngineClient, UpstreamError, describe

log = logging.getLogger(__name__)

JSON = "application/json"
_JSON_HEADERS: Headers = [(b"content-type", b"application/json")]
_SSE_HEADERS: Headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
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
    # an engine's response head, at most this long after the call: 504 (and, when the frontend
    # picked the worker and the client has nothing yet, one try on another worker)
    first_byte_timeout: float = 300.0
    head_timeout: float = HEAD_TIMEOUT_S  # a client's request head, from its first byte: 408
    body_timeout: float = BODY_TIMEOUT_S  # a client's request body, from its head: 408
    kv_events: bool = True  # kv mode: subscribe to the workers' KV events (else approximate)
    kv_curve: Any = None  # kv mode: CURVE on the KV-event subscriptions (protocol.kv_curve)
    router: Any = None  # kv mode: an epp.config.RouterConfig (None: its defaults)
    replicas: Any = None  # kv mode: router.replicas.ReplicaSettings, bookings shared with peers
    # kv mode: router.admission.AdmissionLimits (None: its defaults), 429 past them
    admission: Any = None


def _outcome(status: int) -> str:
    if status < 400:
        return "ok"
    if status == 429:
        return "shed"
    if status == 504:
        return "timeout"
    if status == 503:
        return "unavailable"
    if status >= 500:
        return "upstream_error"
    return "client_error"


async def _send_error(exchange: Exchange, exc: OpenAIError) -> None:
    headers = list(_JSON_HEADERS)
    retry_after = getattr(exc, "retry_after_s", None)  # kv mode sheds load with 429
    if retry_after:
        headers.append((b"retry-after", b"%d" % max(1, math.ceil(retry_after))))
    await exchange.respond(exc.status, exc.json(), headers)


async def _send_json(exchange: Exchange, obj: Any, status: int = 200) -> None:
    await exchange.respond(status, orjson.dumps(obj), _JSON_HEADERS)


def _engine_fields(nvext: NvExt, body: dict[str, Any]) -> bool:
    """Set what the engine takes from `nvext` in its own request fields; whether any was set.

    `greed_sampling`: Dynamo leaves greedy sampling to the backend; vLLM's greedy is
    temperature 0. `agent_hints.priority`: normalised into vLLM's request `priority` as Dynamo
    does (vLLM runs lower values first, Dynamo's hint is higher = more important), unless the
    body names a `priority` of its own."""
    changed = False
    if nvext.greed_sampling:
        body["temperature"] = 0.0
        changed = True
    hints = nvext.agent_hints
    if hints is not None and hints.priority is not None and "priority" not in body:
        body["priority"] = -hints.priority
        changed = True
    return changed


def _bootstrap(route: Route) -> tuple[int, dict[str, Any]] | None:
    """The bootstrap room and the decode leg's transfer parameters, when the route's prefill
    engine advertises a bootstrap address (frontend/handoff.py); None otherwise."""
    if route.prefill is None or route.prefill_target is None:
        return None
    room = bootstrap_room()
    params = bootstrap_params(route.prefill.config, route.prefill_target.dp_rank or 0, room)
    return (room, params) if params is not None else None


def _speculates(nvext: NvExt | None) -> bool:
    """A turn after which the next one is prefilled (`agent_hints.speculative_prefill`): one
    of a session that goes on (a `close` ends it)."""
    if nvext is None or nvext.session_control is None or nvext.agent_hints is None:
        return False
    return bool(nvext.agent_hints.speculative_prefill) and (
        nvext.session_control.action != SessionAction.CLOSE
    )


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
    `async with Frontend(config, discovery) as fe:` or start()/stop(); `fe.url` once started.
    `serve` answers every request of its HTTP server."""

    def __init__(self, config: FrontendConfig, graph: Discovery | None = None):
        self.config = config
        self.metrics = FrontendMetrics()
        self.directory = WorkerDirectory(config.engine_url, graph)
        self.client = EngineClient(
            request_timeout=config.request_timeout,
            connect_timeout=config.connect_timeout,
            first_byte_timeout=config.first_byte_timeout,
        )
        self.routing: RoutingMode = self._routing()
        queue = getattr(getattr(self.routing, "pipeline", None), "queue", None)
        if queue is not None:  # kv mode with a router queue: its metrics on /metrics
            from dynamograph.router.waiting import QueueCollector

            self.metrics.registry.register(QueueCollector(queue))
        replicas = getattr(self.routing, "replicas", None)
        if replicas is not None:  # kv mode with replica sync: `dynamograph_frontend_replica_*`
            from dynamograph.router.replicas import ReplicaCollector

            self.metrics.registry.register(
                ReplicaCollector(replicas, "dynamograph_frontend_replica")
            )
        # path → (methods, handler); HEAD is answered like GET (the server drops the body)
        self._routes = {
            CHAT_COMPLETIONS: (("POST",), self.generate),
            COMPLETIONS: (("POST",), self.generate),
            MODELS: (("GET", "HEAD"), self.models),
            "/health": (("GET", "HEAD"), self.health),
            "/live": (("GET", "HEAD"), self.live),
            "/metrics": (("GET", "HEAD"), self.metrics_page),
        }
        self._server = HttpServer(
            self.serve, head_timeout=config.head_timeout, body_timeout=config.body_timeout
        )
        self.url: str | None = None
        # requests the frontend sends on its own (`_abandoned`, `_speculate`), until they end
        self._background: set[asyncio.Task[None]] = set()
        self._speculative: dict[str, asyncio.Task[None]] = {}  # by session id

    def _routing(self) -> RoutingMode:
        cfg = self.config
        if cfg.mode is Mode.DIRECT:
            return DirectMode(self.directory, enforce_disagg=cfg.enforce_disagg)
        if cfg.mode is Mode.ROUND_ROBIN:
            return RoundRobinMode(self.directory, enforce_disagg=cfg.enforce_disagg)
        from .kv_mode import KvMode  # the router core is paid for only in kv mode

        return KvMode(
            self.directory,
            enforce_disagg=cfg.enforce_disagg,
            kv_events=cfg.kv_events,
            config=cfg.router,
            kv_curve=cfg.kv_curve,
            replicas=cfg.replicas,
            registry=self.metrics.registry,
            admission=cfg.admission,
        )

    # -- lifecycle --
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        await self.client.start()
        await self.directory.start()
        await self.routing.start()
        bound = await self._server.start(host, port)
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{bound}"
        return self.url

    async def stop(self) -> None:
        await self._server.stop()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.routing.stop()
        await self.directory.stop()
        await self.client.stop()

    async def __aenter__(self) -> "Frontend":
        if self.url is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- requests --
    async def serve(self, exchange: Exchange) -> None:
        found = self._routes.get(exchange.path)
        try:
            if found is None:
                await _send_error(exchange, OpenAIError(404, f"no such path: {exchange.path}"))
            elif exchange.method not in found[0]:
                await _send_error(
                    exchange,
                    OpenAIError(405, f"{exchange.method} is not allowed on {exchange.path}"),
                )
            else:
                await found[1](exchange)
        except asyncio.CancelledError:
            if not exchange.gone:
                raise
            # The client went away: nobody to answer, nothing to report (counted already).
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        finally:
            exchange.done()

    # -- small endpoints --
    async def health(self, exchange: Exchange) -> None:
        local = self.directory.local_record
        reason = self.not_ready()
        body: dict[str, Any] = {
            "status": "not ready" if reason else "ok",
            "mode": self.config.mode.value,
            "instance_id": local.instance_id if local else None,
            "workers": len(self.directory.records()),
        }
        if reason is not None:
            body["reason"] = reason
        await _send_json(exchange, body, 503 if reason else 200)

    def not_ready(self) -> str | None:
        """Why the frontend cannot serve yet, or None: its workers (`WorkerDirectory`), and with
        `--enforce-disagg` a prefill worker too (Dynamo's frontend is not ready before one
        exists: every request would fail)."""
        reason = self.directory.not_ready()
        enforced = self.config.enforce_disagg
        if reason is None and enforced and not self.directory.with_roles((Role.PREFILL,)):
            reason = (
                "disaggregated serving is enforced (--enforce-disagg) but no prefill worker is "
                "discovered yet"
            )
        return reason

    async def live(self, exchange: Exchange) -> None:
        """Liveness: the process answers. Unlike /health it does not wait for the engine, so a
        slow model load does not get the sidecar restarted."""
        await _send_json(exchange, {"status": "alive"})

    async def metrics_page(self, exchange: Exchange) -> None:
        for role in Role:
            self.metrics.workers.labels(role.value).set(len(self.directory.with_roles([role])))
        await exchange.respond(
            200, self.metrics.exposition(), [(b"content-type", CONTENT_TYPE.encode())]
        )

    async def models(self, exchange: Exchange) -> None:
        """The local engine's list as it gives it; standalone, the graph's served models and
        LoRA adapters."""
        local = self.directory.local_record
        if local is not None:
            try:
                status, raw = await self.client.get(local, MODELS, "local")
            except UpstreamError as exc:
                await _send_error(exchange, exc)
                return
            await exchange.respond(status, raw, _JSON_HEADERS)
            return
        names = sorted(served_models(r.config for r in self.directory.records()))
        data = [{"id": n, "object": "model", "owned_by": "dynamograph"} for n in names]
        await _send_json(exchange, {"object": "list", "data": data})

    # -- generation --
    async def _read_body(self, exchange: Exchange) -> bytes:
        cap = self.config.max_body_bytes
        try:
            return await exchange.body(cap)
        except BodyTooLarge as exc:
            size = f" of {exc.length} B" if exc.length is not None else ""
            raise OpenAIError(
                413,
                f"request body{size} is over the frontend's limit of {cap} bytes "
                "(--max-body-bytes)",
            ) from None

    async def generate(self, exchange: Exchange) -> None:
        trace = nvext_out.Trace.begin()
        metrics = self.metrics
        mode = self.config.mode.value
        stream = False
        disagg = "false"
        outcome = "ok"
        route: Route | None = None
        handed_off = False  # the booking is `_abandoned`'s to free
        bootstrapping: asyncio.Future[dict[str, Any] | None] | None = None  # its prefill leg
        metrics.started()
        try:
            raw = await self._read_body(exchange)
            exchange.cancel_on_disconnect()
            body = parse_json_body(raw)
            try:
                nvext = parse_nvext(body.get("nvext"))
            except NvExtError as exc:
                raise OpenAIError(400, str(exc), param="nvext") from None
            nvext, pins = merge(nvext, routing_headers(exchange.headers))
            session = nvext.session_control if nvext is not None else None
            if session is not None and self._speculative:
                await self._stop_speculating(session.session_id)
            reject_client_transfer_params(body)
            if nvext is not None and _engine_fields(nvext, body):
                raw = orjson.dumps(body)
            stream = body.get("stream") is True
            route = await self.routing.pick(pins, nvext, exchange.path, body)
            if route.query_answer is not None:
                await self._answer_query(exchange, route.query_answer, stream)
                return
            trace.decode = route.decode_target
            payload = raw
            bootstrap = _bootstrap(route)
            if bootstrap is not None:  # the prefill runs meanwhile; the decode pulls from it
                disagg = "true"
                room, pull_from = bootstrap
                prefill = asyncio.ensure_future(self._prefill(exchange, route, body, trace, room))
                bootstrapping = prefill
                payload = orjson.dumps(decode_request(body, pull_from))
            elif route.prefill is not None:
                disagg = "true"
                prefill = asyncio.ensure_future(self._prefill(exchange, route, body, trace))
                try:
                    params = await asyncio.shield(prefill)
                except asyncio.CancelledError:
                    if exchange.gone:  # the prefill goes on; the decode leg cleans its KV up
                        handed_off = self._abandoned(prefill, exchange, route, body)
                    else:
                        prefill.cancel()
                    raise
                if params is not None:
                    payload = orjson.dumps(decode_request(body, params))
                else:
                    disagg = "fallback"
            answer: list[bytes] | None = [] if _speculates(nvext) else None
            try:
                status = await self._decode(exchange, route, payload, nvext, trace, stream, answer)
            except UpstreamError as exc:
                retry = await self._elsewhere(exc, exchange, route, pins, nvext, body)
                if retry is None:
                    raise
                if route.booking is not None:
                    route.booking.free()
                route = retry
                trace.decode = route.decode_target
                status = await self._decode(exchange, route, payload, nvext, trace, stream, answer)
            outcome = _outcome(trace.stream_error or status)
            if answer is not None and session is not None and outcome == "ok":
                self._speculate(route, exchange.path, body, answer, stream, session.session_id)
        except OpenAIError as exc:
            outcome = _outcome(exc.status)
            if isinstance(exc, UpstreamError):
                log.warning("%s", exc.message)
            await self._fail(exchange, exc)
        except ClientGone:  # the client left before its body arrived: nobody to answer
            outcome = "cancelled"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as exc:  # a bug: answer in OpenAI's shape and count it, not a bare 500
            outcome = "error"
            log.exception("frontend failed on %s", exchange.path)
            await self._fail(
                exchange, OpenAIError(500, f"frontend error: {type(exc).__name__}: {exc}")
            )
        finally:
            metrics.finished(mode, outcome, disagg, stream, trace.elapsed())
            if bootstrapping is not None and route is not None and not bootstrapping.done():
                # the decode leg ended before its prefill could hand its KV over (it failed, or
                # the client left): as for a client leaving during a prefill leg, the prefill
                # runs on and a one-token decode leg then takes and frees its KV
                handed_off = self._abandoned(bootstrapping, exchange, route, body)
            elif bootstrapping is not None and not bootstrapping.cancelled():
                bootstrapping.exception()  # a failed prefill leg was answered by the decode's
            if route is not None and route.booking is not None and not handed_off:
                route.booking.free()

    def _abandoned(
        self,
        prefill: "asyncio.Future[dict[str, Any] | None]",
        exchange: Exchange,
        route: Route,
        body: dict[str, Any],
    ) -> bool:
        """The client left during the prefill leg (or a bootstrap prefill outlived its decode
        leg): as Dynamo, let the prefill finish and still send a decode leg — one token, not
        streamed — so the decode engine pulls the KV the prefill holds for it (else held until
        vLLM's abort timeout, 480 s) and both free it; then free the booking. True: the booking
        is this task's to free."""
        headers = EngineClient.headers(exchange.headers, route.decode_target.dp_rank)
        path = exchange.path

        async def finish() -> None:
            try:
                params = await prefill
                if params is None:  # served aggregated instead: no KV is held anywhere
                    return
                leg = decode_request(prefill_request(body), params)
                status, raw = await self._call(
                    route.decode, path, orjson.dumps(leg), headers, "decode"
                )
                if status != 200:
                    log.warning(
                        "%s: the decode leg of an abandoned request failed with %d: %s",
                        describe(route.decode, "decode"), status, _engine_message(raw),
                    )  # fmt: skip
            except OpenAIError as exc:  # nobody to answer: log it
                if isinstance(exc, UpstreamError) and exc.kind != "handoff":
                    self._upstream_failed(exc, route.decode, "decode")
                log.warning("abandoned request: %s", exc.message)
            finally:
                if route.booking is not None:
                    route.booking.free()

        self._spawn(finish(), "abandoned-prefill")
        return True

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _stop_speculating(self, session_id: str) -> None:
        """The session's next turn arrived: a speculative prefill still running is cancelled
        (its engine request aborted, its booking freed) before the turn is routed."""
        task = self._speculative.pop(session_id, None)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _speculate(
        self,
        route: Route,
        path: str,
        body: dict[str, Any],
        answer: list[bytes],
        stream: bool,
        session_id: str,
    ) -> None:
        """Dynamo's speculative prefill (`agent_hints.speculative_prefill`,
        frontend/speculative.py): the turn's prompt and answer as a one-token request to the
        workers that served the turn — the session's — booked while it runs (kv mode)."""
        text = speculative.answer_text(path, answer, stream)
        spec = speculative.next_turn_body(path, body, text) if text is not None else None
        if spec is None:
            return
        pins = Pins(route.decode_target, route.prefill_target)

        async def prefill_next_turn() -> None:
            leg: Route | None = None
            try:
                leg = await self.routing.pick(pins, None, path, spec)
                payload = orjson.dumps(spec)
                if leg.prefill is not None and leg.prefill_target is not None:
                    headers = EngineClient.headers({}, leg.prefill_target.dp_rank)
                    leg_body = orjson.dumps(prefill_request(spec))
                    _, raw = await self._call(leg.prefill, path, leg_body, headers, "prefill")
                    payload = orjson.dumps(decode_request(spec, transfer_params(orjson.loads(raw))))
                headers = EngineClient.headers({}, leg.decode_target.dp_rank)
                await self._call(leg.decode, path, payload, headers, "decode")
                self.metrics.speculative.labels("done").inc()
            except (OpenAIError, HandoffError, orjson.JSONDecodeError) as exc:
                self.metrics.speculative.labels("failed").inc()
                log.info("speculative prefill of session %s not done: %s", session_id, exc)
            except asyncio.CancelledError:
                self.metrics.speculative.labels("cancelled").inc()
                raise
            finally:
                if leg is not None and leg.booking is not None:
                    leg.booking.free()
                if self._speculative.get(session_id) is asyncio.current_task():
                    del self._speculative[session_id]

        self._speculative[session_id] = self._spawn(prefill_next_turn(), "speculative-prefill")

    @staticmethod
    async def _answer_query(exchange: Exchange, answer: bytes, stream: bool) -> None:
        """A query-only request (`query_instance_id` annotation, Dynamo's GAIE first stage):
        its answer (`router.pipeline.query_answer`), nothing booked and no engine called."""
        await exchange.respond(200, answer, list(_SSE_HEADERS if stream else _JSON_HEADERS))

    @staticmethod
    async def _fail(exchange: Exchange, exc: OpenAIError) -> None:
        """An error answer; once a stream has begun, an in-stream error event that ends it."""
        if not exchange.started:
            await _send_error(exchange, exc)
            return
        await exchange.write(b"data: " + exc.json() + b"\n\n")
        await exchange.end()

    def _upstream_failed(self, exc: UpstreamError, record: WorkerRecord, leg: str) -> None:
        self.metrics.upstream_errors.labels(leg, exc.kind).inc()
        if exc.kind == "connect":
            self.directory.mark_unreachable(record.instance_id)

    async def _prefill(
        self,
        exchange: Exchange,
        route: Route,
        body: dict[str, Any],
        trace: nvext_out.Trace,
        room: int | None = None,
    ) -> dict[str, Any] | None:
        """Run the prefill leg; its `kv_transfer_params`, or None to serve aggregated instead.
        `room`: the bootstrap path's room number, which the prefill holds its KV under."""
        assert route.prefill is not None and route.prefill_target is not None
        record = route.prefill
        started = time.perf_counter()
        trace.prefill = route.prefill_target
        leg = prefill_request(body)
        if room is not None:
            leg[KV_TRANSFER_PARAMS][BOOTSTRAP_ROOM] = room
        try:
            status, raw = await self._call(
                record,
                exchange.path,
                orjson.dumps(leg),
                EngineClient.headers(exchange.headers, route.prefill_target.dp_rank),
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
        exchange: Exchange,
        route: Route,
        payload: bytes,
        nvext: NvExt | None,
        trace: nvext_out.Trace,
        stream: bool,
        answer: list[bytes] | None = None,
    ) -> int:
        """The decode leg, answered to the client; the status sent. `answer` collects the
        engine's response body (a speculative prefill reads the answer's text from it)."""
        record = route.decode
        headers = EngineClient.headers(exchange.headers, route.decode_target.dp_rank)
        want_ext = nvext_out.wanted(nvext)
        try:
            upstream = await self.client.open(record, exchange.path, payload, headers, "decode")
        except UpstreamError as exc:
            self._upstream_failed(exc, record, "decode")
            raise
        if upstream.status == 200 and route.booking is not None:
            route.booking.accepted()  # the engine took the turn: an `open` session binds
        try:
            trace.first_token_s = trace.elapsed()
            is_sse = upstream.content_type == "text/event-stream"
            if not (stream and is_sse and upstream.status == 200):
                try:
                    raw = await self.client.read(upstream, record, "decode")
                except UpstreamError as exc:
                    self._upstream_failed(exc, record, "decode")
                    raise
                if answer is not None:
                    answer.append(raw)
                if want_ext and upstream.status == 200:
                    raw = nvext_out.add_to_body(raw, self._ext(nvext, trace))
                self._first_byte(route, stream, trace)
                content_type = upstream.headers.get("content-type", JSON)
                head = [(b"content-type", content_type.encode("latin-1"))]
                await exchange.respond(upstream.status, raw, head + _passed_headers(upstream))
                self.routing.refresh()  # answered, still awake (see below)
                return upstream.status
            # Awake anyway, and the streaming engine is now prefilling: read the KV events
            # queued since the last pick, so the next one finds fewer left to read on its path.
            self.routing.refresh()
            await self._relay(exchange, upstream, route, nvext, trace, want_ext, answer)
            return 200
        finally:
            _finish(upstream)

    async def _elsewhere(
        self,
        exc: UpstreamError,
        exchange: Exchange,
        route: Route,
        pins: Pins,
        nvext: NvExt | None,
        body: dict[str, Any],
    ) -> Route | None:
        """Another worker for an aggregated request whose engine never answered (connection
        refused, or no response head within --first-byte-timeout), when this frontend picked it
        (kv, round-robin) and the client has been sent nothing; None: no retry. The first
        worker's booking is still held while picking, so a stalled worker is not picked again;
        a connection refused has already taken it out of the directory."""
        if (
            self.config.mode is Mode.DIRECT
            or exc.kind not in ("connect", "first_byte")
            or route.prefill is not None
            or pins.decode is not None
            or exchange.started
        ):
            return None
        try:
            retry = await self.routing.pick(pins, nvext, exchange.path, body)
        except OpenAIError:
            return None
        if retry.decode.instance_id == route.decode.instance_id or retry.prefill is not None:
            if retry.booking is not None:
                retry.booking.free()
            return None
        self.metrics.retries.inc()
        log.warning("%s; trying %s", exc.message, describe(retry.decode, "decode"))
        return retry

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
        exchange: Exchange,
        upstream: Response,
        route: Route,
        nvext: NvExt | None,
        trace: nvext_out.Trace,
        want_ext: bool,
        answer: list[bytes] | None,
    ) -> None:
        """SSE pass-through, chunk by chunk; the final chunk gains `nvext` when asked."""
        record = route.decode
        injector = nvext_out.FinalChunkInjector(self._ext(nvext, trace)) if want_ext else None
        booking = route.booking
        await exchange.start(200, _SSE_HEADERS + _passed_headers(upstream))
        first = True
        last = b""  # the engine's final bytes: they go out with the end of the stream
        while True:
            try:
                chunk = await self.client.read_chunk(upstream, record, "decode")
            except UpstreamError as exc:
                # Headers are sent: report in-stream, as vLLM does, and end the stream.
                self._upstream_failed(exc, record, "decode")
                log.warning("%s", exc.message)
                trace.stream_error = exc.status
                last = b"data: " + exc.json() + b"\n\n"
                break
            if not chunk:
                break
            if first:
                first = False
                trace.first_token_s = trace.elapsed()
                self._first_byte(route, True, trace)
            if booking is not None:
                # each SSE event carries at least one token (more when the engine merged them
                # for a slow reader): the output so far, for the expected output's decay
                booking.add_output_tokens(chunk.count(b"data: "))
            if answer is not None:
                answer.append(chunk)
            if injector is not None:
                chunk = injector.feed(chunk)
                if not chunk:
                    continue
            if upstream.is_eof():  # the engine's answer is complete: this is the last piece
                last = chunk
                break
            await exchange.write(chunk)
        if injector is not None:
            last += injector.close()
        await exchange.end(last)


def _passed_headers(upstream: Response) -> Headers:
    found = upstream.headers
    return [
        (name.encode(), found[name].encode("latin-1"))
        for name in PASSED_RESPONSE_HEADERS
        if name in found
    ]


def _finish(response: Response) -> None:
    """Pool the connection of a fully read response; close one cut short, so that the engine
    sees the disconnect and frees the request."""
    if response.is_eof():
        response.release()
    else:
        response.close()
