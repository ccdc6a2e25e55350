"""`dynamograph bench priority`: time to first token of high-priority requests under overload.

An open-loop Poisson stream (`--rate` requests/s for `--duration-s`, more than the fleet
serves) goes to a kv-mode frontend whose router queues requests while every worker is busy
(`busy_threshold`, `queue_max_requests`); `--high-fraction` of them are marked important. The
same arrivals run twice on a fresh fleet: once with the important ones carrying
`agent_hints.priority` (the router queue's jump, and vLLM's request priority in the engine), once
without any hint. Reported: p50/p90 TTFT (client wall clock, streamed) of the important and of
the other requests in both runs, and how many waited in the router queue.

Everything runs in this process on 127.0.0.1 (mock engines, frontend, clients).
"""

import argparse
import asyncio
import time
from typing import Any

import aiohttp
import numpy as np
import orjson

from .report import add_output_argument, print_table, write_json
from .speculative import MODEL, fleet

COLUMNS = ["priority hints", "class", "requests", "TTFT p50 s", "TTFT p90 s", "errors"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=float, default=30.0, help="arrivals per second (30)")
    parser.add_argument("--duration-s", type=float, default=10.0, help="arrival window (10 s)")
    parser.add_argument("--high-fraction", type=float, default=0.1, help="important share")
    parser.add_argument("--priority", type=int, default=10, help="their agent_hints.priority")
    parser.add_argument("--prompt-tokens", type=int, default=400, help="tokens per prompt")
    parser.add_argument("--output-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--workers", type=int, default=1, help="aggregated workers (1)")
    parser.add_argument("--seed", type=int, default=0)
    add_output_argument(parser)


async def _one(http: aiohttp.ClientSession, url: str, body: bytes) -> float | None:
    """TTFT of one streamed completion; None when it failed."""
    start = time.perf_counter()
    async with http.post(url, data=body, headers={"content-type": "application/json"}) as r:
        if r.status != 200:
            await r.read()
            return None
        ttft = None
        async for raw in r.content:
            if ttft is None and raw.startswith(b"data: {"):
                ttft = time.perf_counter() - start
        return ttft


async def _run(args, prompts: list[str], important: np.ndarray, hinted: bool) -> dict:
    from dynamograph.protocol.router_config import RouterConfig

    # ~8 requests of the default size in flight per worker: the rest waits in the router queue
    router = RouterConfig(busy_threshold=0.025, queue_max_requests=100_000, queue_timeout_s=300)
    arrivals = np.cumsum(
        np.random.default_rng([args.seed, 1]).exponential(1 / args.rate, len(prompts))
    )
    async with fleet(args.workers, False, seed=args.seed, router=router) as fe:
        url = fe.url + "/v1/completions"
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            begin = time.perf_counter()
            tasks = []
            for i, prompt in enumerate(prompts):
                delay = arrivals[i] - (time.perf_counter() - begin)
                if delay > 0:
                    await asyncio.sleep(delay)
                body: dict[str, Any] = {
                    "model": MODEL,
                    "prompt": prompt,
                    "max_tokens": args.output_tokens,
                    "ignore_eos": True,
                    "stream": True,
                }
                if hinted and important[i]:
                    body["nvext"] = {"agent_hints": {"priority": args.priority}}
                tasks.append(asyncio.create_task(_one(http, url, orjson.dumps(body))))
            ttfts = await asyncio.gather(*tasks)
        queue = fe.routing.pipeline.queue
        waited = queue.outcomes["dispatched"] if queue is not None else 0
    out: dict[str, Any] = {"hinted": hinted, "queued": waited}
    for name, mask in (("important", important), ("other", ~important)):
        got = [t for t, m in zip(ttfts, mask, strict=True) if m and t is not None]
        out[name] = {
            "requests": int(mask.sum()),
            "errors": int(mask.sum()) - len(got),
            "ttft_p50_s": float(np.percentile(got, 50)) if got else None,
            "ttft_p90_s": float(np.percentile(got, 90)) if got else None,
        }
    return out


async def _bench(args) -> list[dict]:
    from dynamograph.protocol.tokenization import get_tokenizer

    from .workload import WorkloadBuilder

    builder = WorkloadBuilder(get_tokenizer("qwen"))
    count = int(args.rate * args.duration_s)
    rng = np.random.default_rng([args.seed, 2])
    # every prompt its own text: no prefix is shared, so the cache does not blur the queueing
    prompts = [builder.text(rng, args.prompt_tokens) for _ in range(count)]
    important = rng.random(count) < args.high_fraction
    return [await _run(args, prompts, important, hinted) for hinted in (False, True)]


def run(args: argparse.Namespace) -> int:
    runs = asyncio.run(_bench(args))
    rows = [
        [
            "yes" if r["hinted"] else "no",
            name,
            r[name]["requests"],
            r[name]["ttft_p50_s"],
            r[name]["ttft_p90_s"],
            r[name]["errors"],
        ]
        for r in runs
        for name in ("important", "other")
    ]
    print_table("priority under overload", COLUMNS, rows, width=100)
    settings = {k: v for k, v in vars(args).items() if isinstance(v, int | float | str)}
    summary = {
        "important TTFT p50 s (without, with hints)": [r["important"]["ttft_p50_s"] for r in runs],
        "other TTFT p50 s (without, with hints)": [r["other"]["ttft_p50_s"] for r in runs],
    }
    write_json(args.out, "priority", {"settings": settings, "runs": runs, "summary": summary})
    return 0
