"""`GET /v1/engine` inside a real `vllm serve`: an ASGI middleware vLLM loads with `--middleware`.

vLLM has no such endpoint, and discovery (EPP, frontends) reads every worker's `EngineConfig`
there. `dynamograph worker --engine vllm` builds the document from the flags it
gives vLLM (`vllm.engine_document`), hands it over in $DYNAMOGRAPH_ENGINE_DOC, and passes this
class to `vllm serve --middleware` (vLLM adds a class with `app.add_middleware`).

The one field the flags may not fix is the KV cache size: vLLM sizes it from free GPU memory at
startup unless `--num-gpu-blocks-override` is given. Then the middleware reads it from the running
server's config (`app.state.vllm_config.cache_config.num_gpu_blocks`) and answers 503, which
discovery retries, until vLLM has decided.
"""

import json
import os
from typing import Any

from dynamograph.protocol.engine import ENGINE_PATH, EngineConfig

ENV = "DYNAMOGRAPH_ENGINE_DOC"

_JSON = [(b"content-type", b"application/json")]


def vllm_gpu_blocks(app: Any) -> int | None:
    """The KV cache size a running vLLM server decided on (None while it is unknown)."""
    try:
        blocks = app.state.vllm_config.cache_config.num_gpu_blocks
    except AttributeError:
        return None
    return int(blocks) if blocks else None


class EngineDocument:
    """Answers `GET`/`HEAD /v1/engine` with this worker's `EngineConfig`; passes the rest on."""

    def __init__(self, app: Any, document: dict[str, Any] | None = None) -> None:
        self.app = app
        if document is None:
            raw = os.environ.get(ENV)
            if not raw:
                raise RuntimeError(f"{ENV} is not set: start vLLM with `dynamograph worker`")
            document = json.loads(raw)
        self.document = document
        self._body: bytes | None = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != ENGINE_PATH:
            await self.app(scope, receive, send)
            return
        if scope["method"] not in ("GET", "HEAD"):
            error = _error("use GET /v1/engine", "invalid_request_error")
            await _respond(send, 405, error, scope["method"])
            return
        body = self._render(scope.get("app"))
        if body is None:
            error = _error("vLLM has not sized its KV cache yet; retry", "service_unavailable")
            await _respond(send, 503, error, scope["method"])
            return
        await _respond(send, 200, body, scope["method"])

    def _render(self, app: Any) -> bytes | None:
        if self._body is None:
            document = dict(self.document)
            if not document.get("total_kv_blocks"):
                document["total_kv_blocks"] = vllm_gpu_blocks(app)
                if document["total_kv_blocks"] is None:
                    return None
            self._body = EngineConfig.model_validate(document).model_dump_json().encode()
        return self._body


def _error(message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind}}).encode()


async def _respond(send: Any, status: int, body: bytes, method: str) -> None:
    headers = [*_JSON, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})
