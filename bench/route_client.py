"""Open-loop replay client: sends each trace request at its (compressed) arrival time.

Open loop means arrivals never wait for answers: a slow router builds a queue, as real traffic
would. Every answer's `usage.prompt_tokens_details.cached_tokens` gives the prefix hits the
engine actually had, and `nvext` (asked for with `extra_fields`) names the worker and carries
the engine's simulated timing. Streaming requests also give a client-side TTFT (first token's
arrival); without streaming the client measures only end-to-end latency. In-flight requests
are capped: an arrival over the cap is shed and counted, never queued, so the replay cannot
turn into a closed loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import aiohttp
import orjson

from .route_metrics import ERROR, OK, SHED, RequestResult

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
SHED_STATUSES = {429, 503}


def completion_body(model: str, prompt: str, max_tokens: int, *, stream: bool = False) -> bytes:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": stream,
        # The engine reports who served the request and its simulated timing (nvext extra_fields).
        "nvext": {"extra_fields": ["worker_id", "timing"]},
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def chat_body(
    model: str, messages: Sequence[dict], max_tokens: int, *, stream: bool = False
) -> bytes:
    """A `/v1/chat/completions` body with the same generation settings as `completion_body`."""
    settings = orjson.loads(completion_body(model, "", max_tokens, stream=stream))
    del settings["prompt"]
    # `messages` right after `model`: `body_path` finds it at the start of the body.
    return orjson.dumps({"model": model, "messages": list(messages), **settings})


def body_path(body: bytes) -> str:
    """The endpoint a body built here goes to: chat bodies carry `messages` (right after
    `model`; a prompt's text cannot hold the unescaped key)."""
    return CHAT_COMPLETIONS if b'"messages":' in body[:512] else COMPLETIONS


async def send_one(
    session: aiohttp.ClientSession, url: str, body: bytes, result: RequestResult
) -> RequestResult:
    """POST one completion (streaming or not, as the body says) and fill `result`. Its
    `x-request-id` is `bench-<index>`: the gateway's access log names it (`request_id`)."""
    headers = {"content-type": "application/json", "x-request-id": f"bench-{result.index}"}
    result.sent_at = time.time()
    start = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                result.status = SHED if resp.status in SHED_STATUSES else ERROR
                result.error = f"HTTP {resp.status}: {text}"
                return result
            if resp.content_type == "text/event-stream":
                await _read_stream(resp, result, start)
            else:
                _read_event(orjson.loads(await resp.read()), result, start, False)
            result.e2e_s = time.perf_counter() - start
            if result.error is None and result.output_tokens == 0:
                result.error = "response carried no generated token"
            if result.error is None:
                result.status = OK
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    return result


async def _read_stream(resp: aiohttp.ClientResponse, result: RequestResult, start: float) -> None:
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        _read_event(orjson.loads(data), result, start, True)
        if result.error:
            return


def _read_event(event: dict, result: RequestResult, start: float, streaming: bool) -> None:
    """One response object or SSE chunk: first token time, usage, the engine's nvext."""
    if event.get("error"):
        result.error = f"error: {str(event['error'])[:300]}"
        return
    if result.response_id is None and isinstance(event.get("id"), str):
        result.response_id = event["id"]
    choices = event.get("choices") or []
    if streaming and choices and result.ttft_s is None and _chunk_text(choices[0]):
        # Without streaming the answer arrives whole: the time to first token then comes only
        # from the engine's own report (nvext.timing).
        result.ttft_s = time.perf_counter() - start
    nvext = event.get("nvext")
    if nvext:
        _read_nvext(nvext, result)
    usage = event.get("usage")
    if usage:
        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        result.output_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = int(details.get("cached_tokens") or 0)


def _chunk_text(choice: dict) -> str | None:
    """Generated text of a streamed choice: `text` (completions) or `delta.content` (chat)."""
    return choice.get("text") or (choice.get("delta") or {}).get("content")


def _read_nvext(nvext: dict, result: RequestResult) -> None:
    worker = (nvext.get("worker_id") or {}).get("decode_worker_id")
    if worker is not None:
        result.worker = str(worker)
    timing = nvext.get("timing") or {}
    if timing.get("ttft_ms") is not None:
        result.engine_ttft_s = timing["ttft_ms"] / 1000.0
    if timing.get("total_time_ms") is not None:
        result.engine_e2e_s = timing["total_time_ms"] / 1000.0


async def warm_up(base_url: str, model: str, *, timeout_s: float = 120.0) -> None:
    """One tiny completion and one tiny chat request through a freshly started router, not
    measured: a router's first request of a kind can pay one-off costs (loading a tokenizer,
    compiling a chat template; our EPP's first chat request took ~8 s on a loaded 2-core
    host), which would otherwise land on the first requests of the replay. Failures are left
    to the replay to report."""
    base_url = base_url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    bodies = [
        completion_body(model, "Warm up.", 1),
        chat_body(model, [{"role": "user", "content": "Warm up."}], 1),
    ]
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for body in bodies:
            await send_one(session, base_url + body_path(body), body, RequestResult(index=-1))


async def replay(
    base_url: str,
    offsets: Sequence[float],
    make_body: Callable[[int], bytes],
    *,
    max_in_flight: int = 512,
    timeout_s: float = 600.0,
) -> tuple[list[RequestResult], float]:
    """Send request i at `offsets[i]` seconds after the start; return results and wall time.

    Completion bodies go to `/v1/completions`, chat bodies (`chat_body`) to
    `/v1/chat/completions`."""
    base_url = base_url.rstrip("/")
    results = [RequestResult(index=i) for i in range(len(offsets))]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    in_flight = 0

    async def one(i: int, body: bytes) -> None:
        nonlocal in_flight
        try:
            await send_one(session, base_url + body_path(body), body, results[i])
        finally:
            in_flight -= 1

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks = []
        for i, offset in enumerate(offsets):
            body = make_body(i)  # built before the wait: synthesis stays off the clock
            delay = start + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if in_flight >= max_in_flight:
                results[i].status = SHED
                results[i].error = f"client cap of {max_in_flight} requests in flight"
                continue
            in_flight += 1
            tasks.append(asyncio.create_task(one(i, body)))
        await asyncio.gather(*tasks)
        wall = loop.time() - start
    return results, wall
