"""A Dynamo worker in front of one mock worker: what Dynamo's frontend and KV router route to.

Runs in the bench-only Dynamo venv (`scripts/setup-dynamo.sh`), started by
`bench/route_dynamo.py`: it imports only the standard library, Dynamo's runtime, aiohttp and
`tokenizers`, never dynamograph. It

- registers the model (a local folder, tokens in) on a `generate` endpoint with the KV block
  size and capacity the mock reports at `/v1/engine`, under file-based discovery;
- relays the mock's vLLM-format ZMQ KV events to Dynamo's event plane with Dynamo's own
  `KvEventPublisher` (as Dynamo's vLLM worker does), so the router's index follows the mock's
  real cache;
- forwards each request the router sends it to the mock as a token-id `/v1/completions` and
  answers with the generated token ids (the mock's words are single tokens of the same
  vocabulary, so re-encoding its text gives its ids) and the mock's usage (cached tokens).

Dynamo's frontend answers `nvext.timing` from its own clock, so with `--record` each request's
engine-reported figures (the mock's simulated TTFT and duration, cached tokens) are appended to
a JSONL file that `bench/route_dynamo.py` summarizes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import uvloop
from dynamo.llm import (
    KvEventPublisher,
    ModelInput,
    ModelRuntimeConfig,
    ModelType,
    WorkerType,
    register_model,
)
from dynamo.runtime import DistributedRuntime
from tokenizers import Tokenizer

log = logging.getLogger("dynamo_worker")

# Sampling settings a PreprocessedRequest carries that the mock's /v1/completions takes as is.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty")
STOP_KEYS = ("max_tokens", "min_tokens", "ignore_eos")


class MockForwarder:
    def __init__(self, mock_url: str, model: str, tokenizer: Tokenizer, record: TextIO | None):
        self.log = record
        self.url = mock_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.tokenizer = tokenizer
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # No total timeout: a long answer under load is the benchmark's to time, not ours.
        connector = aiohttp.TCPConnector(limit=0)
        self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout())

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def body(self, request: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(request["token_ids"]),
            "stream": True,
            "stream_options": {"include_usage": True},
            "nvext": {"extra_fields": ["worker_id", "timing"]},
        }
        for key, value in (request.get("sampling_options") or {}).items():
            if key in SAMPLING_KEYS and value is not None:
                body[key] = value
        for key, value in (request.get("stop_conditions") or {}).items():
            if key in STOP_KEYS and value is not None:
                body[key] = value
        return body

    async def generate(self, request: dict[str, Any], context: Any = None):
        """Stream the mock's answer: the text that has arrived as its token ids (Dynamo's
        frontend times the first token), then the finish reason with the mock's usage. What
        arrived together goes out together: a backlogged worker sends fewer, larger frames."""
        assert self.session is not None
        finish, usage, nvext, produced = None, None, None, 0
        async with self.session.post(self.url, json=self.body(request)) as resp:
            if resp.status != 200:
                raise RuntimeError(f"mock answered {resp.status}: {(await resp.text())[:300]}")
            pending = b""
            async for data in resp.content.iter_any():
                *events, pending = (pending + data).split(b"\n\n")
                texts = []
                for raw in events:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                        continue
                    event = json.loads(line[5:])
                    if event.get("error"):
                        raise RuntimeError(f"mock error: {str(event['error'])[:300]}")
                    nvext = event.get("nvext") or nvext
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or []:
                        finish = choice.get("finish_reason") or finish
                        texts.append(choice.get("text") or "")
                text = "".join(texts)
                if text:
                    ids = self.tokenizer.encode(text, add_special_tokens=False).ids
                    produced += len(ids)
                    yield {"token_ids": ids}
        usage = usage or {}
        if produced != usage.get("completion_tokens", produced):
            log.warning("re-encoded %d ids for %s generated tokens", produced, usage)
        self.record(nvext, usage, context.id() if context is not None else None)
        yield {
            "token_ids": [],
            "finish_reason": finish or "length",
            "completion_usage": {
                "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens", produced),
                "total_tokens": usage.get("total_tokens"),
                "prompt_tokens_details": usage.get("prompt_tokens_details"),
            },
        }

    def record(
        self, nvext: dict[str, Any] | None, usage: dict[str, Any], request_id: str | None
    ) -> None:
        """The mock's own report of one request (its simulated timing): Dynamo's frontend
        replaces `nvext.timing` with its own wall clock, so the benchmark reads the engine's
        figures from here, by the request id Dynamo's context carries."""
        if self.log is None:
            return
        timing = (nvext or {}).get("timing") or {}
        details = usage.get("prompt_tokens_details") or {}
        row = {
            "request_id": request_id,
            "ttft_ms": timing.get("ttft_ms"),
            "total_time_ms": timing.get("total_time_ms"),
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
        }
        self.log.write(json.dumps(row) + "\n")


async def mock_engine(mock_url: str) -> dict[str, Any]:
    """The mock's `/v1/engine`: block size, capacity, where it publishes KV events."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.get(mock_url.rstrip("/") + "/v1/engine") as resp,
    ):
        resp.raise_for_status()
        return await resp.json()


async def serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, runtime.shutdown)
    engine = await mock_engine(args.mock_url)
    events = engine.get("kv_events") or {}
    if not events.get("endpoint"):
        raise SystemExit(f"{args.mock_url} publishes no KV events: nothing for the router to index")
    block_size = engine["kv_cache_block_size"]
    endpoint = runtime.endpoint(f"{args.namespace}.backend.generate")
    tokenizer = Tokenizer.from_file(str(Path(args.model_path) / "tokenizer.json"))
    # Line-buffered appends of ~100 bytes per request: not worth a thread.
    record = open(args.record, "a", buffering=1) if args.record else None  # noqa: SIM115, ASYNC230
    forwarder = MockForwarder(args.mock_url, args.model_name, tokenizer, record)
    await forwarder.start()
    # Dynamo's relay: subscribes to the mock's PUB socket (vLLM's format) and republishes each
    # batch on the event plane under this endpoint's worker id.
    publisher = KvEventPublisher(
        endpoint=endpoint,
        kv_block_size=block_size,
        zmq_endpoint=events["endpoint"],
        zmq_topic=events.get("topic") or "",
        # Dynamo's workers default: a worker-side index the router can ask for what it missed
        # (events published before its subscription connected, gaps).
        enable_local_indexer=True,
    )
    config = ModelRuntimeConfig()
    config.context_length = engine.get("context_length")
    config.total_kv_blocks = engine.get("total_kv_blocks")
    config.max_num_seqs = engine.get("max_num_seqs")
    config.max_num_batched_tokens = engine.get("max_num_batched_tokens")
    config.kv_event_publishing_enabled = True
    config.enable_local_indexer = True
    try:
        await register_model(
            ModelInput.Tokens,
            ModelType.Chat | ModelType.Completions,
            endpoint,
            args.model_path,
            args.model_name,
            worker_type=WorkerType.Aggregated,
            kv_cache_block_size=block_size,
            runtime_config=config,
        )
        log.warning("registered %s for %s", args.model_name, args.mock_url)
        await endpoint.serve_endpoint(forwarder.generate, graceful_shutdown=False)
    finally:
        publisher.shutdown()
        await forwarder.close()
        if record is not None:
            record.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mock-url", required=True)
    parser.add_argument("--model-path", required=True, help="local model folder")
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--namespace", default="bench")
    parser.add_argument("--record", help="append the mock's per-request timing here (JSONL)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    uvloop.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
