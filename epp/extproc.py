"""Envoy ext_proc: `envoy.service.ext_proc.v3.ExternalProcessor/Process`, the endpoint-picker
side of the Gateway API Inference Extension protocol.

One gRPC stream is one HTTP request and its response. `Exchange` is the per-stream state machine
(pure: protobuf messages in, protobuf messages out) and `ExtProcService` the grpc.aio servicer
that feeds it. The types are the google-protobuf ones of PyPI `xds-protos`.

Which ext_proc filter settings work (every configuration GAIE's own EPP accepts, and a bit more):
- `protocol_config` on the first message is optional (older Envoys do not send it; then the
  request body is taken to be FULL_DUPLEX_STREAMED, as every gateway configures it).
  `send_body_without_waiting_for_header_response` is not read: in FULL_DUPLEX_STREAMED Envoy
  streams the body without waiting anyway.
- request body FULL_DUPLEX_STREAMED (what Envoy Gateway, Envoy AI Gateway, kgateway, Istio and
  GAIE's reference configuration set) or BUFFERED / BUFFERED_PARTIAL (older kgateway, Envoy AI
  Gateway's `buffered` annotation). NONE and STREAMED fail the stream with FAILED_PRECONDITION
  naming `processing_mode.request_body_mode` (the picker must read the body before Envoy picks
  the upstream, and in STREAMED mode the headers leave before the body has arrived).
- response headers, body and trailers in any mode, including not sent at all.
- with or without `metadata_options.receiving_namespaces: {untyped: [envoy.lb]}` (the
  destination header routes either way) and with or without `allow_mode_override` (the EPP
  never asks for a mode override).

Request path, FULL_DUPLEX_STREAMED:
1. request headers: a method other than GET, HEAD and POST is refused at once (405 with Allow,
   501 for a method HTTP does not define): a CONNECT's body never ends. Otherwise remember them;
   client-sent routing and `x-gateway-*` headers are marked for removal. Header-only requests (end_of_stream on the headers) are routed at once to a random
   ready endpoint.
2. request body chunks: buffered until end_of_stream (413 past `max_body_bytes`); then the picker
   decides and we send the headers response (clear_route_cache, destination and routing headers
   with overwrite semantics, content-length) with the `envoy.lb` dynamic metadata on the SAME
   message, then the body again in chunks of at most 62,000 bytes.
3. trailers: acknowledged (they end the body when they arrive before its end_of_stream).
Request path, BUFFERED: the headers are answered at once (spoofed headers removed); Envoy then
sends the whole body in one message, and the pick rides on the body response (header mutation,
clear_route_cache, `envoy.lb` metadata), the body unchanged. Envoy holds the headers until then.
Refusals are ImmediateResponses with an OpenAI error body (400/404/405/413/429 + Retry-After/501/
503). A query-only request (`query_instance_id` annotation) is answered the same way, with
200 and the answer the frontend's kv mode gives (`Route.answer`): no upstream is called.
Admission (`AdmissionLimits`): at most `max_pending_picks` requests are between their headers
and their pick (body arriving, prompt being tokenized off the event loop, waiting for the
loop), and none while the event loop runs more than `max_loop_lag_s` behind (`router.admission.LoopLag`: the EPP is short of CPU
for what it already holds); past either, a new one is refused at its headers with 429 and
Retry-After (`Admission`).

Response path. Recommended (local/envoy.py, docs/gateways.md): response headers SEND, body NONE,
trailers SEND. The EPP then gets two messages per response and none per chunk: the headers
(status; `RequestGuard.accepted`) and the end of the gRPC stream, which Envoy closes when the
HTTP response ends (with trailers SKIP, Envoy 1.40 closes it right after the response headers
instead, so the booking would be freed at once). Prefill done, without seeing a token: a prompt
with uncached full blocks is marked done by the picked worker's KV events storing its last full
block (`router.prefills`, the same step that emits the first token); any other prompt (shorter
than a block, or cached whole) at the response headers.
When the body is sent (gateways that send it FULL_DUPLEX_STREAMED; `mode_override` cannot turn it
off: Envoy ignores it when either body mode is FULL_DUPLEX_STREAMED, and honours it only with a
BUFFERED request body), each chunk is echoed back unchanged (a prebuilt CONTINUE in the other
modes), the first non-empty one marks the prefill done unless the KV events did first, and
`usage.prompt_tokens_details.cached_tokens` in the response's tail (when the worker reports it)
is compared with the index's prediction at its end. The end of the response (end of stream on
headers, body or trailers) frees the booking. Whatever ends the gRPC stream (end of response,
error, client disconnect, or Envoy closing it when the response end is not sent to the EPP),
`Exchange.close()` frees the booking.
"""

import http
import logging
import re
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2

from dynamograph.protocol.headers import (
    DESTINATION_ENDPOINT,
    DESTINATION_SERVED,
    DESTINATION_SUBSET,
    is_spoofable,
)
from dynamograph.protocol.openai import OpenAIError
from dynamograph.router.active import RequestGuard
from dynamograph.router.admission import Admission, AdmissionLimits, LoopLag

from .metrics import OUTCOME_BY_STATUS, EppMetrics

log = logging.getLogger(__name__)

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
MAX_CHUNK_BYTES = 62_000
DEFAULT_MAX_BODY_BYTES = 10 * 1024 * 1024
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
_Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = _Mode.FULL_DUPLEX_STREAMED
BUFFERED_MODES = frozenset({_Mode.BUFFERED, _Mode.BUFFERED_PARTIAL})
SERVED_REQUEST_MODES = frozenset({FULL_DUPLEX, *BUFFERED_MODES})
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_USAGE_TAIL_BYTES = 16 * 1024
# What the OpenAI API is called with. Any other method is answered at its request headers: a
# CONNECT's body never ends, so waiting for it would hold the stream (and Envoy's request) open.
ALLOWED_METHODS = ("GET", "HEAD", "POST")
_ALLOW = ", ".join(ALLOWED_METHODS).encode()
_HTTP_METHODS = frozenset(http.HTTPMethod)  # known but not allowed: 405; unknown: 501
_CACHED_RE = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_PROMPT_RE = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')


class ProtocolViolation(Exception):
    """Envoy is configured in a way the EPP cannot work with (→ FAILED_PRECONDITION)."""


@dataclass(slots=True)
class Route:
    """A picker's decision: where the request goes and which headers tell the frontend."""

    endpoint: str  # "ip:port[,ip:port…]"
    headers: Mapping[str, str]  # routing headers (protocol.headers.routing_header_values)
    guard: RequestGuard | None = None
    worker_id: int | None = None
    prompt_tokens: int = 0
    predicted_cached_tokens: int = 0
    # a query-only request (`query_instance_id` annotation): answered by the EPP itself with
    # this body (`router.pipeline.query_answer`) and content type, no upstream called
    answer: bytes | None = None
    answer_type: str = "application/json"


class EndpointPicker(Protocol):
    async def pick(
        self, path: str, headers: Mapping[str, str], body: bytes, subset: frozenset[str] | None
    ) -> Route:
        """Route a request with a body; raises OpenAIError to refuse it."""
        ...

    def pick_any(self, subset: frozenset[str] | None) -> Route:
        """Route a header-only request (GET /v1/models) to a random ready endpoint."""
        ...

    def refresh(self) -> None:
        """Bring what picks read up to date, off any request's path (the process is awake)."""
        ...


def check_protocol_config(config: pb.ProtocolConfiguration) -> None:
    """Refuse a request body mode the EPP cannot serve; every other setting works.

    The picker reads the model and prompt from the body before Envoy chooses the upstream:
    FULL_DUPLEX_STREAMED (Envoy streams the body and holds the headers until the EPP answers
    them) and BUFFERED / BUFFERED_PARTIAL (the pick rides on the body response) allow that;
    NONE never shows the body, and STREAMED releases the headers before the body is read.
    """
    mode = config.request_body_mode
    if mode in SERVED_REQUEST_MODES:
        return
    raise ProtocolViolation(
        "the endpoint picker needs the request body before it picks, but the ext_proc filter "
        f"sends it in mode {_Mode.BodySendMode.Name(mode)}: set "
        "processing_mode.request_body_mode to FULL_DUPLEX_STREAMED (with request_trailer_mode: "
        "SEND), as GAIE's reference configuration does; BUFFERED works too"
    )


def _subset_hint(metadata: base_pb2.Metadata) -> frozenset[str] | None:
    """GAIE subset hint: filter_metadata["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-
    subset"], a list of "ip:port" (a comma-separated string is accepted too). None = no hint."""
    if SUBSET_NAMESPACE not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[SUBSET_NAMESPACE].fields
    if DESTINATION_SUBSET not in fields:
        return None
    value = fields[DESTINATION_SUBSET]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [v.string_value for v in value.list_value.values]
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        items = []
    return frozenset(item.strip() for item in items if item.strip())


def immediate_response(error: OpenAIError) -> pb.ProcessingResponse:
    headers = [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
            append_action=_OVERWRITE,
        )
    ]
    retry_after = getattr(error, "retry_after_s", None)
    if retry_after is not None:
        headers.append(
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(
                    key="retry-after", raw_value=str(max(1, round(retry_after))).encode()
                ),
                append_action=_OVERWRITE,
            )
        )
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=error.json(),
            details=f"dynamograph_epp_{OUTCOME_BY_STATUS.get(error.status, 'error')}",
        )
    )


def _answer_response(route: Route) -> pb.ProcessingResponse:
    """The EPP's own 200 answer to a query-only request: Envoy sends it to the client and calls
    no upstream."""
    assert route.answer is not None
    content_type = base_pb2.HeaderValue(key="content-type", raw_value=route.answer_type.encode())
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=200),
            headers=pb.HeaderMutation(
                set_headers=[
                    base_pb2.HeaderValueOption(header=content_type, append_action=_OVERWRITE)
                ]
            ),
            body=route.answer,
            details="dynamograph_epp_query_answered",
        )
    )


def _headers_response(
    route: Route, body_length: int | None, spoofed: list[str], *, on_body: bool = False
) -> pb.ProcessingResponse:
    """The pick as Envoy needs it: on the request headers response (FULL_DUPLEX_STREAMED,
    header-only requests) or, `on_body`, on the body response (BUFFERED: Envoy still holds the
    headers then, and applies the mutation and the metadata before it picks the upstream)."""
    # Built by mutating one message in place: upb copies every sub-message handed to a
    # constructor, which made the nested-constructor form ~4x slower (68 vs 18 µs here).
    response = pb.ProcessingResponse()
    common = response.request_body.response if on_body else response.request_headers.response
    common.clear_route_cache = True
    mutation = common.header_mutation
    add = mutation.set_headers.add
    header = add(append_action=_OVERWRITE).header
    header.key = DESTINATION_ENDPOINT
    header.raw_value = route.endpoint.encode()
    for key, value in route.headers.items():
        header = add(append_action=_OVERWRITE).header
        header.key = key
        header.raw_value = value.encode()
    if body_length is not None:
        header = add(append_action=_OVERWRITE).header
        header.key = "content-length"
        header.raw_value = b"%d" % body_length
    if spoofed:
        # Names we set are overwritten anyway; the rest of the client's copies are removed.
        ours = {DESTINATION_ENDPOINT, *route.headers}
        mutation.remove_headers.extend(name for name in spoofed if name not in ours)
    lb = response.dynamic_metadata.fields[LB_NAMESPACE].struct_value
    lb.fields[DESTINATION_ENDPOINT].string_value = route.endpoint
    return response


def _body_chunk(chunk: bytes, end_of_stream: bool, *, response: bool) -> pb.ProcessingResponse:
    message = pb.ProcessingResponse()
    body = message.response_body if response else message.request_body
    streamed = body.response.body_mutation.streamed_response
    streamed.body = chunk
    streamed.end_of_stream = end_of_stream
    return message


def body_chunks(body: bytes, *, end_of_stream: bool = True) -> list[pb.ProcessingResponse]:
    """The request body re-streamed in chunks of at most 62,000 bytes (at least one chunk)."""
    if len(body) <= MAX_CHUNK_BYTES:
        return [_body_chunk(body, end_of_stream, response=False)]  # no copy
    view = memoryview(body)
    last = len(body) - 1
    return [
        _body_chunk(
            bytes(view[i : i + MAX_CHUNK_BYTES]),
            end_of_stream and i + MAX_CHUNK_BYTES > last,
            response=False,
        )
        for i in range(0, len(body), MAX_CHUNK_BYTES)
    ]


_RESPONSE_HEADERS_ACK = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_RESPONSE_BODY_ACK = pb.ProcessingResponse(response_body=pb.BodyResponse())
_REQUEST_HEADERS_ACK = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_REQUEST_TRAILERS_ACK = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
_RESPONSE_TRAILERS_ACK = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def _spoofed_removal(spoofed: list[str]) -> pb.ProcessingResponse:
    response = pb.ProcessingResponse()
    response.request_headers.response.header_mutation.remove_headers.extend(spoofed)
    return response


class Exchange:
    """The state of one ext_proc stream: one HTTP request, its pick, and its response."""

    __slots__ = (
        "_admission",
        "_admitted",
        "_body",
        "_body_size",
        "_first_token_seen",
        "_headers",
        "_metrics",
        "_path",
        "_picker",
        "_request_mode",
        "_response_mode",
        "_routed",
        "_spoofed",
        "_subset",
        "_tail",
        "done",
        "max_body_bytes",
        "response_complete",
        "response_started",
        "route",
        "status",
    )

    def __init__(
        self,
        picker: EndpointPicker,
        metrics: EppMetrics,
        max_body_bytes: int,
        admission: Admission | None = None,
    ):
        self._picker = picker
        self._metrics = metrics
        self._admission = admission
        self._admitted = False
        self.max_body_bytes = max_body_bytes
        self._headers: dict[str, str] | None = None
        self._spoofed: list[str] = []
        self._path = ""
        self._subset: frozenset[str] | None = None
        self._body: list[bytes] = []
        self._body_size = 0
        self._routed = False
        self._first_token_seen = False
        self._tail = bytearray()
        # Body modes from protocol_config; without one (older Envoys), what gateways configure.
        self._request_mode = FULL_DUPLEX
        self._response_mode = FULL_DUPLEX
        self.route: Route | None = None
        self.status: int | None = None  # upstream response status
        self.done = False  # an ImmediateResponse was sent: nothing more to do
        self.response_started = False  # response headers seen
        self.response_complete = False

    @property
    def response_body_sent(self) -> bool:
        """Whether Envoy sends the response body to the EPP (per protocol_config)."""
        return self._response_mode != _Mode.NONE

    # -- dispatch --
    async def on_message(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if self._headers is None and message.HasField("protocol_config"):
            config = message.protocol_config
            check_protocol_config(config)
            self._request_mode = config.request_body_mode
            self._response_mode = config.response_body_mode
        kind = message.WhichOneof("request")
        try:
            if kind == "request_headers":
                return self._on_request_headers(message)
            if kind == "request_body":
                return await self._on_request_body(message.request_body)
            if kind == "request_trailers":
                answers = await self._end_of_body(trailers=True)
                return answers if self.done else [*answers, _REQUEST_TRAILERS_ACK]
            if kind == "response_headers":
                return self._on_response_headers(message.response_headers)
            if kind == "response_body":
                return self._on_response_body(message.response_body)
            if kind == "response_trailers":
                self._end_of_response()
                return [_RESPONSE_TRAILERS_ACK]
        except OpenAIError as error:
            return [self._refuse(error)]
        except ProtocolViolation:
            raise
        except Exception as exc:  # a bug must not hang the client: answer 500 and say so
            log.exception("endpoint picker failed on a %s message", kind)
            self.close()
            return [self._refuse(OpenAIError(500, f"endpoint picker error: {exc!r:.200}"))]
        raise ProtocolViolation(f"unexpected ProcessingRequest without a request kind ({kind})")

    def _refuse(self, error: OpenAIError) -> pb.ProcessingResponse:
        self.done = True
        self._body.clear()
        self._leave()
        self._metrics.requests.labels(OUTCOME_BY_STATUS.get(error.status, "error")).inc()
        log.info("request refused", extra={"status": error.status, "reason": error.message})
        return immediate_response(error)

    # -- request --
    def _on_request_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        headers: dict[str, str] = {}
        spoofed = self._spoofed
        for header in message.request_headers.headers.headers:
            key = header.key.lower()
            if is_spoofable(key):
                spoofed.append(key)
                continue
            headers[key] = header.raw_value.decode("latin-1") if header.raw_value else header.value
        self._headers = headers
        self._path = headers.get(":path", "/").split("?", 1)[0]
        method = headers.get(":method", "")
        if method not in ALLOWED_METHODS:
            return [self._refuse_method(method)]
        self._subset = _subset_hint(message.metadata_context)
        if not message.request_headers.end_of_stream:
            if self._admission is not None:
                self._admission.enter()  # 429 at once when too many wait to be routed
                self._admitted = True
            if self._request_mode in BUFFERED_MODES:
                # Envoy waits for this answer before it sends the (buffered) body; the pick
                # goes on the body response. The client's copies go now.
                return [_spoofed_removal(spoofed) if spoofed else _REQUEST_HEADERS_ACK]
            return []
        # Header-only request (GET /v1/models, health checks): any ready endpoint will do.
        route = self._picker.pick_any(self._subset)
        self._routed = True
        self.route = route
        self._metrics.routed_header_only.inc()
        return [_headers_response(route, None, spoofed)]

    def _refuse_method(self, method: str) -> pb.ProcessingResponse:
        known = method in _HTTP_METHODS
        response = self._refuse(
            OpenAIError(
                405 if known else 501,
                f"method {method!r} is {'not allowed' if known else 'not implemented'}: the "
                f"inference API takes {', '.join(ALLOWED_METHODS)}",
            )
        )
        allow = response.immediate_response.headers.set_headers.add(append_action=_OVERWRITE)
        allow.header.key = "allow"
        allow.header.raw_value = _ALLOW
        return response

    async def _on_request_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self._headers is None:
            raise ProtocolViolation("request body before request headers")
        if self._routed:
            raise ProtocolViolation("request body after the request was routed")
        chunk = body.body
        if chunk:
            self._body_size += len(chunk)
            if self._body_size > self.max_body_bytes:
                raise OpenAIError(
                    413,
                    f"request body exceeds {self.max_body_bytes} bytes; send a smaller request "
                    "(the limit is the EPP's --max-body-bytes)",
                )
            self._body.append(chunk)
        if self._request_mode in BUFFERED_MODES:
            if not (body.end_of_stream or body.end_of_stream_without_message):
                # BUFFERED_PARTIAL past the gateway's buffer: the rest would bypass the EPP.
                raise OpenAIError(
                    413,
                    "request body exceeds the gateway's ext_proc buffer (BUFFERED_PARTIAL "
                    "sent part of it); send a smaller request or raise the listener's "
                    "per_connection_buffer_limit_bytes",
                )
            body_bytes = b"".join(self._body)
            self._body.clear()
            return [await self._pick(body_bytes, on_body=True)]
        if body.end_of_stream or body.end_of_stream_without_message:
            return await self._end_of_body(trailers=False)
        return []

    async def _end_of_body(self, *, trailers: bool) -> list[pb.ProcessingResponse]:
        if self._routed:
            return []
        body = b"".join(self._body)
        self._body.clear()
        if self._request_mode in BUFFERED_MODES:
            # Trailers and no body: the headers are answered already, so no pick can reach Envoy.
            raise OpenAIError(400, "a request body is required")
        picked = await self._pick(body, on_body=False, body_length=len(body))
        if self.done:  # answered by the EPP itself: the body goes nowhere
            return [picked]
        return [picked, *body_chunks(body, end_of_stream=not trailers)]

    async def _pick(
        self, body: bytes, *, on_body: bool, body_length: int | None = None
    ) -> pb.ProcessingResponse:
        assert self._headers is not None
        start = time.perf_counter()
        route = await self._picker.pick(self._path, self._headers, body, self._subset)
        self._metrics.pick_seconds.observe(time.perf_counter() - start)
        self._leave()
        self._routed = True
        if route.answer is not None:  # query-only: the answer is ours, nothing was booked
            self.done = True
            self._metrics.query_answered.inc()
            return _answer_response(route)
        self.route = route
        self._metrics.routed.inc()
        if route.prompt_tokens:
            self._metrics.prompt_tokens.inc(route.prompt_tokens)
            self._metrics.predicted_cached_tokens.inc(route.predicted_cached_tokens)
        spoofed = [] if on_body else self._spoofed  # removed on the headers answer already
        return _headers_response(route, body_length, spoofed, on_body=on_body)

    # -- response --
    def _on_response_headers(self, headers: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        self.response_started = True
        for header in headers.headers.headers:
            key = header.key
            if key == ":status":
                value = header.raw_value or header.value.encode()
                self.status = int(value) if value.isdigit() else None
            elif key == DESTINATION_SERVED and self.route is not None:
                served = (header.raw_value or header.value.encode()).decode("latin-1")
                if served and served not in self.route.endpoint.split(","):
                    self._metrics.served_mismatch.inc()
                    log.info("served endpoint %s differs from pick %s", served, self.route.endpoint)
        if self.status is not None:
            self._metrics.response_status(self.status)
        if self.status == 200 and self.route is not None and self.route.guard is not None:
            self.route.guard.accepted()  # the engine took the turn: an `open` session binds
        if headers.end_of_stream:
            self._end_of_response()
        elif not self.response_body_sent and not self._awaits_stored_blocks():
            self._mark_first_token()  # the closest sign of it the EPP will get
        return [_RESPONSE_HEADERS_ACK]

    def _awaits_stored_blocks(self) -> bool:
        """The worker's KV events will mark the prefill done (the prompt's last full block is
        not stored yet): more precise than the response headers, which a streaming engine
        sends before it computes anything."""
        route = self.route
        return route is not None and route.guard is not None and route.guard.awaits_stored_blocks

    def _mark_first_token(self) -> None:
        route = self.route
        if not self._first_token_seen and route is not None and route.guard is not None:
            self._first_token_seen = True
            route.guard.mark_prefill_done()

    def _on_response_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        chunk = body.body
        route = self.route
        if chunk and route is not None and route.guard is not None:
            self._mark_first_token()
            # Keep only the tail: usage comes last (the final SSE event or the end of the JSON).
            # Appended in place and trimmed now and then: copying the tail on every chunk
            # cost O(16 KiB) per streamed token.
            tail = self._tail
            tail += chunk
            if len(tail) > 2 * _USAGE_TAIL_BYTES:
                del tail[:-_USAGE_TAIL_BYTES]
        end = body.end_of_stream or body.end_of_stream_without_message
        if end:
            self._observe_usage()
            self._end_of_response()
        if self._response_mode == FULL_DUPLEX:
            return [_body_chunk(chunk, body.end_of_stream, response=True)]
        return [_RESPONSE_BODY_ACK]  # STREAMED / BUFFERED: continue, unchanged

    def _observe_usage(self) -> None:
        route = self.route
        if route is None or not self._tail or self.status != 200:
            return
        cached = _CACHED_RE.findall(self._tail)
        prompt = _PROMPT_RE.findall(self._tail)
        if cached and prompt:
            self._metrics.observe_usage(
                route.predicted_cached_tokens, int(cached[-1]), int(prompt[-1])
            )

    def _end_of_response(self) -> None:
        self.response_complete = True
        self.close()

    def _leave(self) -> None:
        if self._admitted:
            self._admitted = False
            self._admission.leave()  # type: ignore[union-attr]

    def close(self) -> None:
        """End of the exchange, however it ended: free the booking (idempotent)."""
        self._leave()
        route = self.route
        if route is not None and route.guard is not None:
            route.guard.free()


class ExtProcService(pb_grpc.ExternalProcessorServicer):
    """grpc.aio servicer: one `Exchange` per stream, closed however the stream ends."""

    def __init__(
        self,
        picker: EndpointPicker,
        metrics: EppMetrics,
        *,
        admission: AdmissionLimits,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        retry_after_s: float = 1.0,
        loop_lag: LoopLag | None = None,
    ):
        self.picker = picker
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.admission = Admission(admission, retry_after_s, loop_lag)

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = Exchange(self.picker, self.metrics, self.max_body_bytes, self.admission)
        self.metrics.active_streams.inc()
        try:
            async for message in request_iterator:
                try:
                    responses = await exchange.on_message(message)
                except ProtocolViolation as exc:
                    log.error("ext_proc protocol: %s", exc)
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
                for response in responses:
                    yield response
                if message.HasField("response_headers"):
                    # Awake anyway and answered: read the KV events queued since the last
                    # read now, so the next pick has fewer left to read on its request's path.
                    self.picker.refresh()
                if exchange.done or exchange.response_complete:
                    # Nothing is left to process: end the stream now (status OK) rather than
                    # wait for Envoy's half-close, one read fewer per request. Envoy treats
                    # a server close as "no more processing" for the rest of the request.
                    break
        finally:
            if (
                exchange.route is not None
                and not exchange.response_complete
                and (exchange.response_body_sent or not exchange.response_started)
            ):
                # Envoy ended the stream before the response did: client gone or upstream reset.
                # (When the response body is not sent to the EPP, Envoy closing the stream is
                # how the EPP learns that the response ended: not counted as cancelled.)
                self.metrics.responses.labels("cancelled").inc()
            exchange.close()
            self.metrics.active_streams.dec()
