"""`dynamograph up --bench`: a short prefix-heavy workload that shows what KV routing buys.

Requests share a few long "system prompt" prefixes (like agents or chat apps with a fixed
preamble), interleaved so consecutive requests rarely share one. The same workload shape (fresh
prefixes, so no pass finds the other's cache warm) runs twice:

- `kv`: through Envoy, the EPP picks the worker by KV overlap and load;
- `round-robin`: straight to the workers' frontend sidecars in turn, as a load balancer without
  cache awareness would (these requests also skip the Envoy and EPP hops, so any TTFT gap is
  conservative).

Hit rate comes from the engines' own prefix-cache counters (tokens found / tokens looked up,
during the pass); TTFT is measured by the client on streamed responses.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass

import aiohttp
import numpy as np
import orjson

from .stack import Running
from .status import EngineSample, scrape

WORDS = [
    "cache",
    "block",
    "token",
    "route",
    "worker",
    "engine",
    "prefix",
    "decode",
    "prefill",
    "batch",
    "queue",
    "latency",
    "gateway",
    "picker",
    "overlap",
    "score",
    "tensor",
    "kernel",
    "memory",
    "page",
    "budget",
    "cluster",
    "replica",
    "session",
    "model",
    "request",
    "stream",
    "header",
    "event",
    "index",
    "hash",
    "shard",
    "rank",
    "pool",
    "policy",
    "agent",
    "tool",
    "result",
    "answer",
]


@dataclass(frozen=True)
class Workload:
    groups: int = 8  # distinct shared prefixes
    per_group: int = 8  # requests per prefix
    prefix_words: int = 600  # shared part; each word is about one token
    suffix_words: int = 12  # unique part of each request
    max_tokens: int = 8
    concurrency: int = 4


@dataclass(frozen=True)
class PassResult:
    name: str
    requests: int
    errors: int
    hit_rate: float | None
    ttft_ms: list[float]
    workers_per_prefix: float  # mean distinct workers that served one prefix (1 = perfect)

    def ttft(self, q: float) -> float:
        return float(np.percentile(self.ttft_ms, q)) if self.ttft_ms else float("nan")


def prompts(workload: Workload, seed: int) -> list[tuple[int, str]]:
    """(group, prompt) pairs in send order: round-robin over groups."""
    rng = random.Random(seed)
    prefixes = [
        f"[{seed}-{g}] " + " ".join(rng.choices(WORDS, k=workload.prefix_words))
        for g in range(workload.groups)
    ]
    out = []
    for i in range(workload.per_group):
        for g in range(workload.groups):
            tail = " ".join(rng.choices(WORDS, k=workload.suffix_words))
            out.append((g, f"{prefixes[g]}\nQuestion {i}: {tail}?"))
    return out


async def stream_chat(
    session: aiohttp.ClientSession, base_url: str, model: str, prompt: str, max_tokens: int
) -> tuple[float, int | None]:
    """Send one streamed chat completion; (TTFT in ms, decode worker id from nvext)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "nvext": {"extra_fields": ["worker_id"]},
    }
    start = time.perf_counter()
    ttft = None
    worker = None
    async with session.post(
        f"{base_url}/chat/completions",
        data=orjson.dumps(body),
        headers={"content-type": "application/json"},
    ) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = orjson.loads(line[5:])
            if ttft is None and any(
                (c.get("delta") or {}).get("content") for c in chunk.get("choices", [])
            ):
                ttft = (time.perf_counter() - start) * 1000
            ids = (chunk.get("nvext") or {}).get("worker_id") or {}
            worker = ids.get("decode_worker_id", worker)
    return (ttft if ttft is not None else (time.perf_counter() - start) * 1000), worker


async def run_pass(
    name: str,
    targets: list[str],
    model: str,
    workload: Workload,
    engines: list[Running],
    seed: int,
) -> PassResult:
    """Send the workload, cycling over `targets` (base URLs); one target = all through it."""
    cycle = itertools.cycle(targets)
    plan = [(g, p, next(cycle)) for g, p in prompts(workload, seed)]
    sem = asyncio.Semaphore(workload.concurrency)
    ttfts: list[float] = []
    served: dict[int, set] = {}
    errors = 0

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        before = await scrape(session, engines)

        async def one(group: int, prompt: str, target: str) -> None:
            nonlocal errors
            async with sem:
                try:
                    ttft, worker = await stream_chat(
                        session, target, model, prompt, workload.max_tokens
                    )
                except (aiohttp.ClientError, RuntimeError, TimeoutError):
                    errors += 1
                    return
            ttfts.append(ttft)
            served.setdefault(group, set()).add(worker if worker is not None else target)

        await asyncio.gather(*(one(g, p, t) for g, p, t in plan))
        after = await scrape(session, engines)
    return PassResult(
        name=name,
        requests=len(plan),
        errors=errors,
        hit_rate=_hit_rate(before, after),
        ttft_ms=ttfts,
        workers_per_prefix=float(np.mean([len(s) for s in served.values()])) if served else 0.0,
    )


def _hit_rate(
    before: dict[str, EngineSample | None], after: dict[str, EngineSample | None]
) -> float | None:
    hits = queries = 0.0
    for name, end in after.items():
        start = before.get(name)
        if end is None or start is None:
            continue
        hits += end.prefix_hits - start.prefix_hits
        queries += end.prefix_queries - start.prefix_queries
    return hits / queries if queries else None


async def compare(
    base_url: str, model: str, running: list[Running], workload: Workload, seed: int
) -> list[PassResult]:
    """The kv pass through Envoy, then the round-robin pass over the sidecars."""
    engines = [p for p in running if p.spec.kind == "engine" and p.exit_code is None]
    sidecars = [f"http://{p.spec.serving}/v1" for p in engines if p.spec.serving]
    kv = await run_pass("kv (Envoy + EPP)", [base_url], model, workload, engines, seed)
    rr = await run_pass(
        "round-robin (no cache awareness)", sidecars, model, workload, engines, seed + 1
    )
    return [kv, rr]


def table_rows(results: list[PassResult]) -> list[list]:
    return [
        [
            r.name,
            r.requests - r.errors,
            r.errors,
            "-" if r.hit_rate is None else f"{r.hit_rate:.1%}",
            r.ttft(50),
            r.ttft(90),
            r.workers_per_prefix,
        ]
        for r in results
    ]


COLUMNS = [
    "routing",
    "ok",
    "errors",
    "prefix hit rate",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "workers per prefix",
]
