"""llm-d's tokenizer service contract, served with dynamograph's tokenizers: what llm-d's
precise prefix-cache scorer tokenizes prompts through (bench-only).

llm-d's scheduler built without cgo has no tokenizer of its own: its kv-cache indexer calls a
gRPC `tokenization.TokenizationService` on a Unix socket (llm-d-kv-cache `pkg/tokenization`,
`uds` pool). llm-d ships that service as a Python sidecar (llm-d-kv-cache
`services/uds_tokenizer`) that needs vLLM's CPU wheels, which are not on PyPI. This module
serves the same contract, the messages compiled at start from the `.proto` in Go's module cache
(the llm-d-kv-cache version the pinned scheduler is built against), and tokenizes exactly as
the mock workers do (`protocol.tokenization.request_tokens`), so the prompt's tokens are the
ones the workers' KV events carry:
- `InitializeTokenizer`: loads the tokenizer (any model name: one tokenizer serves the bench);
- `RenderCompletion` / `Tokenize`: a completions prompt's token ids;
- `RenderChatCompletion` / `RenderChatTemplate`: chat messages rendered with the tokenizer's
  chat template, and their token ids.
A failure is answered in the response (`success: false`, `error_message`), as llm-d's service
does; the scheduler then scores without prefix information.

    python -m dynamograph.bench.llmd_tokenizer --socket PATH --proto FILE [--tokenizer SPEC]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import logging
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

from dynamograph.protocol.openai import CHAT_COMPLETIONS, COMPLETIONS, OpenAIError
from dynamograph.protocol.tokenization import DEFAULT_TOKENIZER, get_tokenizer, request_tokens

log = logging.getLogger(__name__)

PROTO = Path("api") / "tokenizerpb" / "tokenizer.proto"  # in the llm-d-kv-cache module


def compile_proto(proto: Path, out: Path) -> tuple[ModuleType, ModuleType]:
    """`proto`'s messages and service stubs (grpcio-tools' protoc into `out`), imported."""
    from grpc_tools import protoc

    code = protoc.main(
        [
            "protoc",
            f"-I{proto.parent}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(proto),
        ]
    )
    if code != 0:
        raise RuntimeError(f"protoc could not compile {proto} (exit {code})")
    sys.path.insert(0, str(out))
    try:
        stem = proto.stem
        return importlib.import_module(f"{stem}_pb2"), importlib.import_module(f"{stem}_pb2_grpc")
    finally:
        sys.path.remove(str(out))


def _messages(pb_messages: Any) -> list[dict[str, Any]]:
    """llm-d's ChatMessages as OpenAI messages (text parts joined; tool calls as sent)."""
    out = []
    for m in pb_messages:
        if m.HasField("content"):
            content: Any = m.content
        else:
            content = [
                {"type": "text", "text": p.text} for p in m.content_parts if p.type == "text"
            ]
        message: dict[str, Any] = {"role": m.role, "content": content}
        if m.HasField("tool_calls_json"):
            message["tool_calls"] = json.loads(m.tool_calls_json)
        out.append(message)
    return out


def _prompt_body(prompt: str) -> dict[str, Any]:
    return {"prompt": prompt}


def _chat_body(request: Any) -> dict[str, Any]:
    """llm-d's RenderChatCompletionRequest as an OpenAI chat request body."""
    body: dict[str, Any] = {"messages": _messages(request.messages)}
    kwargs = {}
    if request.HasField("chat_template_kwargs") and request.chat_template_kwargs:
        kwargs = json.loads(request.chat_template_kwargs)
    if request.HasField("add_generation_prompt"):
        kwargs["add_generation_prompt"] = request.add_generation_prompt
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    if request.HasField("tools_json") and request.tools_json:
        body["tools"] = json.loads(request.tools_json)
    return body


class TokenizerService:
    """The servicer: every method answers from `tokenizer_spec`'s tokenizer."""

    def __init__(self, pb: ModuleType, tokenizer_spec: str):
        self.pb = pb
        self.spec = tokenizer_spec
        self.calls = 0

    def _answer(
        self, reply: Any, field: str, path: str, body: Callable[[Any], dict[str, Any]], of: Any
    ) -> Any:
        """`reply` with the token ids of the OpenAI request `body(of)` at `path`, in `field`; a
        request it cannot tokenize (or a malformed JSON field) as `success: false`."""
        self.calls += 1
        try:
            ids = request_tokens(get_tokenizer(self.spec, fast=True), path, body(of)).tolist()
        except (OpenAIError, ValueError) as exc:
            message = exc.message if isinstance(exc, OpenAIError) else str(exc)
            return reply(success=False, error_message=message)
        return reply(success=True, **{field: ids})

    def InitializeTokenizer(self, request: Any, context: Any) -> Any:
        try:
            get_tokenizer(self.spec, fast=True)
        except Exception as exc:  # a tokenizer that cannot load: say so, as llm-d's does
            return self.pb.InitializeTokenizerResponse(success=False, error_message=str(exc))
        return self.pb.InitializeTokenizerResponse(success=True)

    def RenderCompletion(self, request: Any, context: Any) -> Any:
        reply = self.pb.RenderCompletionResponse
        return self._answer(reply, "token_ids", COMPLETIONS, _prompt_body, request.prompt)

    def Tokenize(self, request: Any, context: Any) -> Any:
        reply = self.pb.TokenizeResponse
        return self._answer(reply, "input_ids", COMPLETIONS, _prompt_body, request.input)

    def RenderChatCompletion(self, request: Any, context: Any) -> Any:
        reply = self.pb.RenderChatCompletionResponse
        return self._answer(reply, "token_ids", CHAT_COMPLETIONS, _chat_body, request)

    def RenderChatTemplate(self, request: Any, context: Any) -> Any:
        messages = [m for turn in request.conversation_turns for m in _messages(turn.messages)]
        try:
            rendered = get_tokenizer(self.spec, fast=True).render_chat(
                messages, add_generation_prompt=request.add_generation_prompt
            )
        except Exception as exc:  # a template error, reported to the caller
            return self.pb.ChatTemplateResponse(success=False, error_message=str(exc))
        return self.pb.ChatTemplateResponse(success=True, rendered_prompt=rendered)


@contextlib.asynccontextmanager
async def serving(socket: Path, proto: Path, tokenizer_spec: str = DEFAULT_TOKENIZER):
    """The service on `socket` (a Unix socket path) until the block ends; yields the servicer."""
    with tempfile.TemporaryDirectory(prefix="llmd-tokenizer-") as out:
        pb, pb_grpc = compile_proto(proto, Path(out))
    servicer = TokenizerService(pb, tokenizer_spec)
    server = grpc.aio.server()
    pb_grpc.add_TokenizationServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    try:
        yield servicer
    finally:
        await server.stop(grace=1)


async def _serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with serving(Path(args.socket), Path(args.proto), args.tokenizer):
        log.info("llm-d tokenizer service on unix://%s (%s)", args.socket, args.tokenizer)
        await stop.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", required=True, help="Unix socket path to serve on")
    parser.add_argument("--proto", required=True, help="llm-d-kv-cache's tokenizer.proto")
    parser.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="tokenizer spec")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
