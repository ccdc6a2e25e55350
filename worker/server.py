"""The worker's HTTP server (aiohttp): vLLM's OpenAI surface in front of an `LLMEngine`.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (SSE streaming and not),
`GET /v1/models`, `GET /health`, `GET /metrics`, `GET /v1/engine` (protocol.engine.EngineConfig),
vLLM's `POST /tokenize` / `POST /detokenize` / `POST /v1/{chat/,}completions/render` / `POST /reset_prefix_cache` / `GET /version`,
the hand-off's `POST /v1/kv_transfer/pull`, and `GET /debug/requests` (what this worker served,
so tests and operators can check routing from the worker's side).

`model` is the served model name or one of the LoRA adapters (`--lora-modules`), which
`/v1/models` lists with `parent` = the served model, as vLLM does; any other name is a 404 with
vLLM's message.

Every generation response carries `x-dynamograph-worker-id` (the instance id) and
`x-dynamograph-dp-rank` headers. A client that disconnects cancels its request, which frees
its KV blocks (handler cancellation is on).
"""

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import time
import uuid
from collections import Counter, deque
from typing import Any

import orjson
from aiohttp import web

from dynamograph.protocol.engine import (
    DEBUG_REQUESTS_PATH,
    ENGINE_PATH,
    EngineConfig,
    Role,
    served_models,
)
from dynamograph.protocol.headers import VLLM_DP_RANK, parse_routing_headers
from dynamograph.protocol.identity import instance_id
from dynamograph.protocol.nvext import NvExtError, parse_nvext
from dynamograph.protocol.openai import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    MODELS,
    OpenAIError,
    parse_json_body,
    require_model,
)
from dynamograph.protocol.tokenization import request_tokens

from . import http_guard
from .engine import EngineError, EngineOutput, FinishReason, RequestContext
from .handoff import PULL_PATH
from .http_limits import BODY_TIMEOUT_S, HEAD_TIMEOUT_S, MAX_BODY_BYTES
from .lora import adapter_cards
from .metrics import CONTENT_TYPE
from .mock import MockEngine, held_to_json
from .responses import ResponseBuilder, build_request, nvext_body

log = logging.getLogger(__name__)

WORKER_ID_HEADER = "x-dynamograph-worker-id"
DP_RANK_HEADER = "x-dynamograph-dp-rank"
REQUEST_ID_HEADER = "x-request-id"
RECENT_REQUESTS = 1000
MAX_REQUEST_ID = 256
# Keyword arguments of WorkerServer beyond the engine, host and port (worker.testing passes them).
SERVER_OPTIONS = ("max_body_bytes", "head_timeout", "body_timeout")


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(body), status=status, content_type="application/json", headers=headers
    )


def _error(exc: OpenAIError | EngineError) -> web.Response:
    err = (
        exc
        if isinstance(exc, OpenAIError)
        else OpenAIError(exc.status, exc.message, param=exc.param)
    )
    return _json(err.body(), status=err.status)


class RequestLog:
    """Counts and the last RECENT_REQUESTS generation requests this worker served."""

    def __init__(self) -> None:
        self.total = 0
        self.by_rank: Counter[int] = Counter()
        self.by_path: Counter[str] = Counter()
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_REQUESTS)

    def record(self, entry: dict[str, Any]) -> None:
        self.total += 1
        self.by_rank[entry["dp_rank"]] += 1
        self.by_path[entry["path"]] += 1
        self.recent.append(entry)

    def body(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "by_dp_rank": {str(k): v for k, v in sorted(self.by_rank.items())},
            "by_path": dict(self.by_path),
            "recent": list(self.recent),
        }


class WorkerServer:
    """Binds the HTTP port first (so port 0 works), then starts the engine behind it."""

    def __init__(
        self,
        engine: MockEngine,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        max_body_bytes: int = MAX_BODY_BYTES,
        head_timeout: float = HEAD_TIMEOUT_S,
        body_timeout: float = BODY_TIMEOUT_S,
    ):
        self.engine = engine
        self.host = host
        self.port = port
        self.max_body_bytes = max_body_bytes
        self.head_timeout = head_timeout
        self.body_timeout = body_timeout
        self.config: EngineConfig | None = None
        self._models: dict[str, str | None] = {}
        self.requests = RequestLog()
        self._runner: web.AppRunner | None = None
        self._listening: asyncio.AbstractServer | None = None
        self.app = self._build_app()

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post(COMPLETIONS, self.generate)
        app.router.add_post(CHAT_COMPLETIONS, self.generate)
        app.router.add_get(MODELS, self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get(ENGINE_PATH, self.engine_info)
        app.router.add_post(COMPLETIONS + "/render", self.render)
        app.router.add_post(CHAT_COMPLETIONS + "/render", self.render)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_get("/version", self.version)
        app.router.add_post(PULL_PATH, self.kv_pull)
        app.router.add_get(DEBUG_REQUESTS_PATH, self.debug_requests)
        return app

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    async def start(self, name: str | None = None) -> EngineConfig:
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        limits = http_guard.Limits(
            max_body_bytes=self.max_body_bytes,
            head_timeout=self.head_timeout,
            body_timeout=self.body_timeout,
        )
        self._listening, self.port = await http_guard.serve(
            self._runner, self.host, self.port, limits
        )
        self.engine.config.port = self.port
        try:
            self.config = await self.engine.start(instance_id(name or self.engine.config.name))
        except BaseException:
            await self.stop()
            raise
        self._models = served_models([self.config])
        return self.config

    async def stop(self) -> None:
        await self.engine.cleanup()
        if self._listening is not None:
            self._listening.close()
            self._listening = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- plain endpoints -----------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.config is None:
            return _json({"status": "starting"}, status=503)
        if self.engine.draining:  # routers stop sending before the process goes away
            return _json({"status": "draining"}, status=503)
        return web.Response(status=200)

    async def engine_info(self, request: web.Request) -> web.Response:
        if self.config is None:
            return _error(OpenAIError(503, "engine is starting"))
        # Without adapters the field is left out: routers older than it refuse unknown fields.
        exclude = None if self.config.lora_adapters else {"lora_adapters"}
        body = self.config.model_dump_json(exclude=exclude)
        return web.Response(body=body, content_type="application/json")

    async def models(self, request: web.Request) -> web.Response:
        cfg = self.engine.config
        created = int(time.time())
        return _json({
            "object": "list",
            "data": [{
                "id": cfg.served, "object": "model", "created": created,
                "owned_by": "dynamograph", "root": cfg.model, "parent": None,
                "max_model_len": cfg.context_length,
            }, *adapter_cards(cfg.lora_modules, cfg.served, created)],
        })  # fmt: skip

    async def metrics(self, request: web.Request) -> web.Response:
        if self.engine.metrics is None:
            return web.Response(status=503, text="engine is starting")
        return web.Response(
            body=self.engine.metrics.render(), headers={"Content-Type": CONTENT_TYPE}
        )

    async def version(self, request: web.Request) -> web.Response:
        from importlib.metadata import version

        return _json({"version": version("dynamograph"), "engine": "mock"})

    def _refuse_admin(self, request: web.Request, *, debug: bool) -> web.Response | None:
        """None when `request` may use an admin endpoint, else its refusal. With an admin token
        (`--admin-token`, `$DYNAMOGRAPH_ADMIN_TOKEN`) every admin endpoint needs it as
        `Authorization: Bearer …` (401 otherwise); without one, the KV pull is open (the
        hand-off needs it) and the debug endpoints are off (404) unless `--debug-endpoints`."""
        cfg = self.engine.config
        if cfg.admin_token:
            sent = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if hmac.compare_digest(sent, f"Bearer {cfg.admin_token}".encode()):
                return None
            response = _error(OpenAIError(
                401, f"{request.path} needs this worker's admin token as 'Authorization: Bearer "
                "<token>' (the graph's $DYNAMOGRAPH_ADMIN_TOKEN)"))  # fmt: skip
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        if not debug or cfg.debug_endpoints:
            return None
        return _error(OpenAIError(
            404, f"{request.path} is off: start the worker with --debug-endpoints, or with "
            "--admin-token and send it as 'Authorization: Bearer <token>'"))  # fmt: skip

    async def debug_requests(self, request: web.Request) -> web.Response:
        if (refused := self._refuse_admin(request, debug=True)) is not None:
            return refused
        return _json(self.requests.body())

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if (refused := self._refuse_admin(request, debug=True)) is not None:
            return refused
        busy = [r.rank for r in self.engine.ranks if not r.reset_prefix_cache()]
        if busy:
            return _error(OpenAIError(409, f"ranks {busy} have requests running; retry when idle"))
        return web.Response(status=200)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        return parse_json_body(await request.read())

    def _check_model(self, body: dict[str, Any]) -> str | None:
        """The LoRA adapter the body's `model` names (None: the base model); 404 if neither."""
        model = require_model(body)
        if model not in self._models:
            raise OpenAIError(404, f"The model `{model}` does not exist.", param="model")
        return self._models[model]

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            if "model" in body:
                self._check_model(body)
            path = CHAT_COMPLETIONS if "messages" in body else COMPLETIONS
            tokens = request_tokens(self.engine.tokenizer, path, body)
        except OpenAIError as exc:
            return _error(exc)
        return _json({
            "count": len(tokens), "max_model_len": self.engine.config.context_length,
            "tokens": tokens.tolist(),
        })  # fmt: skip

    async def render(self, request: web.Request) -> web.Response:
        """vLLM's renderer API: the token-in request(s) a completion or chat body becomes.

        Chat answers one GenerateRequest object; completions a list (one per prompt), as vLLM.
        """
        path = request.path.removesuffix("/render")
        try:
            body = await self._body(request)
            self._check_model(body)
            prompts = body.get("prompt")
            if (
                path == COMPLETIONS
                and isinstance(prompts, list)
                and prompts
                and all(isinstance(p, str) for p in prompts)
            ):
                bodies = [{**body, "prompt": p} for p in prompts]
            else:
                bodies = [body]
            rendered = [self._rendered(path, b) for b in bodies]
        except OpenAIError as exc:
            return _error(exc)
        return _json(rendered if path == COMPLETIONS else rendered[0])

    def _rendered(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        tokens = request_tokens(self.engine.tokenizer, path, body)
        sampling = {
            k: body[k]
            for k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                      "frequency_penalty", "presence_penalty", "ignore_eos")
            if k in body
        }  # fmt: skip
        prefix = "chatcmpl" if path == CHAT_COMPLETIONS else "cmpl"
        return {
            "request_id": f"{prefix}-{uuid.uuid4().hex}",
            "token_ids": tokens.tolist(),
            "sampling_params": sampling,
            "model": body["model"],
            "stream": bool(body.get("stream", False)),
            "stream_options": body.get("stream_options"),
            "kv_transfer_params": body.get("kv_transfer_params"),
            "token_offsets": None,
        }

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise OpenAIError(400, "'tokens' must be a list of token ids", param="tokens")
        except OpenAIError as exc:
            return _error(exc)
        return _json({"prompt": self.engine.tokenizer.decode(tokens)})

    async def kv_pull(self, request: web.Request) -> web.Response:
        if (refused := self._refuse_admin(request, debug=False)) is not None:
            return refused
        if self.engine.config.role is not Role.PREFILL:  # only a prefill engine holds KV for one
            return _error(OpenAIError(
                404, f"{PULL_PATH} is served by prefill engines only; this one is "
                f"{self.engine.config.role.value}"))  # fmt: skip
        try:
            body = await self._body(request)
            engine_id, request_id = body.get("remote_engine_id"), body.get("remote_request_id")
            if not isinstance(engine_id, str) or not isinstance(request_id, str):
                raise OpenAIError(400, "pull needs remote_engine_id and remote_request_id strings")
            wait_s = body.get("wait_s", 0)  # a bootstrap pull: wait for the prefill to finish
            if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or wait_s < 0:
                raise OpenAIError(400, "wait_s must be a number of seconds >= 0", param="wait_s")
        except OpenAIError as exc:
            return _error(exc)
        if wait_s:
            held = await self.engine.wait_transfer(engine_id, request_id, wait_s)
        else:
            held = self.engine.take_transfer(engine_id, request_id)
        if held is None:
            return _error(OpenAIError(404, f"no held KV for request {request_id} on {engine_id} "
                                           "(never prefilled here, already pulled, or timed out)"))  # fmt: skip
        return _json(held_to_json(held, self.engine.config.block_size))

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.config is None:
            return _error(OpenAIError(503, "engine is starting"))
        path = request.path
        try:
            body = await self._body(request)
            lora_name = self._check_model(body)
            try:
                nvext = parse_nvext(body.get("nvext"))
            except NvExtError as exc:
                raise OpenAIError(400, str(exc), param="nvext") from None
            tokens = await asyncio.to_thread(request_tokens, self.engine.tokenizer, path, body)
            prefix = "chatcmpl" if path == CHAT_COMPLETIONS else "cmpl"
            client_id = _client_request_id(request)
            request_id = client_id or f"{prefix}-{uuid.uuid4().hex}"
            if self.engine.has_request(request_id):  # a client reusing an id: keep ours unique
                request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
            gen = build_request(
                request_id, path, body, tokens, nvext,
                dp_rank=_dp_rank_header(request),
                context_length=self.engine.config.context_length,
                default_max_tokens=self.engine.config.default_max_tokens,
                priority_scheduling=self.engine.config.scheduling_policy == "priority",
            )  # fmt: skip
            gen.lora_name = lora_name
            self.engine.check_limits(gen)
            gen.dp_rank = self.engine.pick_rank(gen).rank
        except (OpenAIError, EngineError) as exc:
            return _error(exc)
        headers = {
            WORKER_ID_HEADER: str(self.config.instance_id),
            DP_RANK_HEADER: str(gen.dp_rank),
            REQUEST_ID_HEADER: gen.request_id,
        }
        # the body's id as vLLM's: the endpoint's prefix before the client's x-request-id
        response_id = f"{prefix}-{gen.request_id}" if client_id else gen.request_id
        builder = ResponseBuilder(path, response_id, body["model"])
        ctx = RequestContext(gen.request_id)
        stream = self.engine.generate(gen, ctx)
        entry = {
            "request_id": gen.request_id, "path": path, "dp_rank": gen.dp_rank,
            "prompt_tokens": len(tokens), "lora_name": gen.lora_name,
            "routing": _routing(request),
            "kv_transfer": bool(gen.kv_transfer_params), "received": time.time(),
        }  # fmt: skip
        self.requests.record(entry)
        try:
            if body.get("stream"):
                return await self._stream(request, stream, builder, body, gen, headers, entry)
            return await self._full(stream, builder, gen, headers, entry)
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()

    def _extra(self, gen, last: EngineOutput, received: float) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        assert self.config is not None  # generate() answers 503 until the engine has started
        if last.kv_transfer_params is not None:
            extra["kv_transfer_params"] = last.kv_transfer_params
        nv = nvext_body(gen.nvext, last, instance_id=self.config.instance_id,
                        prefill=self.engine.config.role is Role.PREFILL,
                        received_ms=received * 1e3)  # fmt: skip
        if nv:
            extra["nvext"] = nv
        return extra

    @staticmethod
    def _record(entry: dict[str, Any], last: EngineOutput | None) -> None:
        """Complete a request's log entry (it was logged on arrival) with how it ended."""
        if last is not None and last.usage is not None:
            entry["cached_tokens"] = last.usage.cached_tokens
            entry["completion_tokens"] = last.usage.completion_tokens
        if last is not None and last.timing is not None:  # simulated seconds, as in nvext.timing
            entry["ttft_s"] = last.timing.ttft
            entry["e2e_s"] = last.timing.e2e
        entry["finish_reason"] = last.finish_reason.value if last and last.finish_reason else None

    async def _full(self, stream, builder: ResponseBuilder, gen, headers, entry) -> web.Response:
        texts: list[str] = []
        last: EngineOutput | None = None
        try:
            async for out in stream:
                if last is None:
                    entry["first_output"] = time.time()  # the engine's first token
                texts.append(out.text)
                last = out
        except EngineError as exc:
            self._record(entry, None)
            return _error(exc)
        self._record(entry, last)
        if last is None or last.finish_reason is FinishReason.ERROR:
            error = last.error if last is not None else None
            return _json(OpenAIError(503, error or "engine error").body(), 503, headers)
        return _json(
            builder.full("".join(texts), last, self._extra(gen, last, entry["received"])),
            headers=headers,
        )

    async def _stream(
        self, request, stream, builder, body, gen, headers, entry
    ) -> web.StreamResponse:
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})  # fmt: skip
        last: EngineOutput | None = None
        try:
            first = await anext(stream)
        except EngineError as exc:
            self._record(entry, None)
            return _error(exc)
        entry["first_output"] = time.time()  # the engine's first token
        try:
            await response.prepare(request)
            opening = builder.first_chunk()
            if opening:
                await response.write(_sse(opening))
            out = first
            while True:
                last = out
                if out.finish_reason is FinishReason.ERROR:
                    err = OpenAIError(503, out.error or "engine error").body()
                    await response.write(_sse(err))
                    break
                extra = self._extra(gen, out, entry["received"]) if out.is_terminal else None
                await response.write(_sse(builder.chunk(out, extra)))
                if out.is_terminal:
                    if include_usage and out.usage is not None:
                        await response.write(_sse(builder.usage_chunk(out.usage)))
                    break
                out = await anext(stream)
            self._record(entry, last)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            # The client went away; closing the stream (generate's finally) aborts the request.
            entry["finish_reason"] = FinishReason.CANCELLED.value
        return response


def _sse(body: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


def _dp_rank_header(request: web.Request) -> int | None:
    raw = request.headers.get(VLLM_DP_RANK)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise OpenAIError(400, f"{VLLM_DP_RANK} must be a non-negative integer, got {raw!r:.20}")
    return value


def _client_request_id(request: web.Request) -> str | None:
    """The client's `x-request-id`: printable ASCII of at most MAX_REQUEST_ID characters, else
    400. It is echoed in a response header and kept in `/debug/requests`, so bytes that are not
    text (aiohttp hands non-UTF-8 over as surrogates) must not get in."""
    raw = request.headers.get(REQUEST_ID_HEADER)
    if raw is None or raw == "":
        return None
    if len(raw) > MAX_REQUEST_ID or not (raw.isascii() and raw.isprintable()):
        try:
            sent = raw.encode("utf-8", "surrogateescape")  # the bytes as they came
        except UnicodeEncodeError:
            sent = raw.encode("utf-8", "backslashreplace")
        raise OpenAIError(
            400,
            f"{REQUEST_ID_HEADER} must be printable ASCII of at most {MAX_REQUEST_ID} "
            f"characters, got {sent[:40]!r}",
        )
    return raw


def _routing(request: web.Request) -> dict[str, int]:
    """The routing headers a router set on this request (seen from the worker's side)."""
    parsed = dataclasses.asdict(parse_routing_headers(request.headers))
    return {k: v for k, v in parsed.items() if v is not None}
