"""`dynamograph up --bench`: a short prefix-heavy workload that shows what KV routing buys.

Requests share a few long "system prompt" prefixes (like agents or chat apps with a fixed
preamble), arriving in random order. The same workload shape (fresh
prefixes, so no pass finds the other's cache warm) runs twice:

- `kv`: through Envoy, the EPP picks the worker by KV overlap and load;
- `round-robin`: straight to the workers' frontend sidecars in turn, each request pinned to that
  sidecar's own engine (`x-worker-instance-id`), as a load balancer without cache awareness
  would route (these requests also skip the Envoy and EPP hops, so any TTFT gap is
  conservative).

Hit rate and the engine-side TTFT (queueing + prefill, no network) come from the engines' own
metrics (prefix-cache counters, TTFT histogram) during the pass; the client-side TTFT is measured
on streamed responses and includes every hop.
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
from rich.table import Table

from dynamograph.protocol.engine import ENGINE_PATH, EngineConfig
from dynamograph.protocol.headers import WORKER_INSTANCE_ID

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
    prefix_words: int = 1500  # shared part; each word is about one token
    suffix_words: int = 12  # unique part of each request
    max_tokens: int = 8
    concurrency: int = 2


@dataclass(frozen=True)
class PassResult:
    name: str
    requests: int
    errors: int
    hit_rate: float | None
    engine_ttft_ms: float | None  # mean, from the engines' own TTFT histograms
    ttft_ms: list[float]  # measured by the client
    workers_per_prefix: float  # mean distinct workers that served one prefix (1 = perfect)

    def ttft(self, q: float) -> float:
        return float(np.percentile(self.ttft_ms, q)) if self.ttft_ms else float("nan")


def prompts(workload: Workload, seed: int) -> list[tuple[int, str]]:
    """(group, prompt) pairs in send order."""
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
    # Arrival order is random: a fixed interleaving could line groups up with the round-robin
    # cycle and hand round-robin a perfect affinity by accident.
    rng.shuffle(out)
    return out


@dataclass(frozen=True)
class Target:
    base_url: str
    headers: tuple[tuple[str, str], ...] = ()


async def stream_chat(
    session: aiohttp.ClientSession, target: Target, model: str, prompt: str, max_tokens: int
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
        f"{target.base_url}/chat/completions",
        data=orjson.dumps(body),
        headers={"content-type": "application/json", **dict(target.headers)},
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
    targets: list[Target],
    model: str,
    workload: Workload,
    engines: list[Running],
    seed: int,
) -> PassResult:
    """Send the workload, cycling over `targets`; one target = all through it."""
    cycle = itertools.cycle(targets)
    plan = [(g, p, next(cycle)) for g, p in prompts(workload, seed)]
    sem = asyncio.Semaphore(workload.concurrency)
    ttfts: list[float] = []
    served: dict[int, set] = {}
    errors = 0

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        before = await scrape(session, engines)

        async def one(group: int, prompt: str, target: Target) -> None:
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
            served.setdefault(group, set()).add(worker if worker is not None else target.base_url)

        await asyncio.gather(*(one(g, p, t) for g, p, t in plan))
        after = await scrape(session, engines)
    return PassResult(
        name=name,
        requests=len(plan),
        errors=errors,
        hit_rate=_delta_ratio(before, after, "prefix_hits", "prefix_queries"),
        engine_ttft_ms=_ms(_delta_ratio(before, after, "ttft_sum", "ttft_count")),
        ttft_ms=ttfts,
        workers_per_prefix=float(np.mean([len(s) for s in served.values()])) if served else 0.0,
    )


def _delta_ratio(
    before: dict[str, EngineSample | None],
    after: dict[str, EngineSample | None],
    numerator: str,
    denominator: str,
) -> float | None:
    """Σ Δnumerator / Σ Δdenominator over the engines, during one pass."""
    top = bottom = 0.0
    for name, end in after.items():
        start = before.get(name)
        if end is None or start is None:
            continue
        top += getattr(end, numerator) - getattr(start, numerator)
        bottom += getattr(end, denominator) - getattr(start, denominator)
    return top / bottom if bottom else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


async def compare(
    base_url: str, model: str, running: list[Running], workload: Workload, seed: int
) -> list[PassResult]:
    """The kv pass through Envoy, then the round-robin pass over the sidecars."""
    engines = [p for p in running if p.spec.kind == "engine" and p.exit_code is None]
    sidecars = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for engine in engines:
            if engine.spec.serving:
                async with session.get(f"{engine.spec.engine_url}{ENGINE_PATH}") as resp:
                    config = EngineConfig.model_validate_json(await resp.read())
                pin = ((WORKER_INSTANCE_ID, str(config.instance_id)),)
                sidecars.append(Target(f"http://{engine.spec.serving}/v1", pin))
    kv = await run_pass("kv (Envoy + EPP)", [Target(base_url)], model, workload, engines, seed)
    rr = await run_pass(
        "round-robin (no cache awareness)", sidecars, model, workload, engines, seed + 1
    )
    return [kv, rr]


def results_table(results: list[PassResult]) -> Table:
    table = Table(title="KV-aware routing vs round-robin, same workload shape")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == COLUMNS[0] else "right", no_wrap=True)
    for r in results:
        table.add_row(
            r.name,
            f"{r.requests - r.errors}/{r.requests}",
            "-" if r.hit_rate is None else f"{r.hit_rate:.1%}",
            "-" if r.engine_ttft_ms is None else f"{r.engine_ttft_ms:.1f}",
            f"{r.ttft(50):.1f}",
            f"{r.ttft(90):.1f}",
            f"{r.workers_per_prefix:.2f}",
        )
    return table


COLUMNS = [
    "routing",
    "ok",
    "prefix hit rate",
    "engine TTFT mean ms",
    "client TTFT p50 ms",
    "client TTFT p90 ms",
    "workers per prefix",
]
