"""Open-loop replay client: sends each trace request at its (compressed) arrival time.

Open loop means arrivals never wait for answers: a slow router builds a queue, as real traffic
would. Every request streams (`stream: true` with usage) so the first token's arrival gives
TTFT and the last chunk's `usage.prompt_tokens_details.cached_tokens` gives the prefix hits
the engine actually had. In-flight requests are capped: an arrival over the cap is shed and
counted, never queued, so the replay cannot turn into a closed loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import aiohttp
import orjson

from .route_metrics import ERROR, OK, SHED, RequestResult

COMPLETIONS = "/v1/completions"
SHED_STATUSES = {429, 503}


def completion_body(model: str, prompt: str, max_tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


async def send_one(
    session: aiohttp.ClientSession, url: str, body: bytes, result: RequestResult
) -> RequestResult:
    """POST one streaming completion and fill `result` with what happened."""
    start = time.perf_counter()
    try:
        async with session.post(
            url, data=body, headers={"content-type": "application/json"}
        ) as resp:
            result.http_status = resp.status
            if resp.status != 200:
                text = (await resp.text())[:300]
                result.status = SHED if resp.status in SHED_STATUSES else ERROR
                result.error = f"HTTP {resp.status}: {text}"
                return result
            chunks = 0
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = orjson.loads(data)
                if event.get("error"):
                    result.error = f"stream error: {str(event['error'])[:300]}"
                    return result
                choices = event.get("choices") or []
                if choices and (choices[0].get("text") or choices[0].get("delta")):
                    chunks += 1
                    if result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - start
                usage = event.get("usage")
                if usage:
                    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
            result.e2e_s = time.perf_counter() - start
            if result.ttft_s is None:
                result.error = "stream ended without a token"
                return result
            result.output_tokens = result.output_tokens or chunks
            result.status = OK
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    return result


async def replay(
    base_url: str,
    offsets: Sequence[float],
    make_body: Callable[[int], bytes],
    *,
    max_in_flight: int = 512,
    timeout_s: float = 600.0,
) -> tuple[list[RequestResult], float]:
    """Send request i at `offsets[i]` seconds after the start; return results and wall time."""
    url = base_url.rstrip("/") + COMPLETIONS
    results = [RequestResult(index=i, arrival_s=t) for i, t in enumerate(offsets)]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    in_flight = 0

    async def one(i: int, body: bytes) -> None:
        nonlocal in_flight
        try:
            await send_one(session, url, body, results[i])
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
