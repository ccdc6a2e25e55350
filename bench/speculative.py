"""`dynamograph bench speculative`: speculative prefill on a multi-turn workload.

Agent-like sessions talk to a kv-mode frontend over HTTP, each turn streamed: turn k+1's
messages are turn k's messages, the answer the engine actually gave (not a synthesised one, so
the answer's own KV can be reused) and a short new user message (`WorkloadBuilder` text), sent
`--think-s` after the answer ended. The same sessions run with and without
`agent_hints.speculative_prefill` on a fresh fleet each, aggregated (`--workers` mock workers)
and disaggregated (as many prefill and decode workers); reported per run: the follow-up turns'
TTFT (client wall clock, p50/p90), their prompt tokens the engine found cached, and how many
speculative prefills were done or cancelled.

Everything runs in this process on 127.0.0.1 (mock engines, frontend, clients), so the TTFTs
carry this host's CPU noise; the engines' cost model is slowed on prefill (`--token-us` µs of
compute per uncached prompt token, about a 70B dense model on one GPU instead of the default
8B) so that the prefill the speculation saves is not lost in that noise.
"""

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import orjson

from .report import add_output_argument, print_table, write_json

MODEL = "Qwen/Qwen3-0.6B"
COLUMNS = ["fleet", "speculative", "follow-ups", "TTFT p50 ms", "TTFT p90 ms", "cached %"]
COLUMNS += ["spec done", "spec cancelled"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=6, help="concurrent sessions (6)")
    parser.add_argument("--turns", type=int, default=4, help="turns per session (4)")
    parser.add_argument("--think-s", type=float, default=1.0, help="pause between turns (1 s)")
    parser.add_argument("--answer-tokens", type=int, default=128, help="tokens per answer")
    parser.add_argument("--user-tokens", type=int, default=64, help="tokens per new message")
    parser.add_argument("--system-tokens", type=int, default=600, help="tokens of the system")
    parser.add_argument("--workers", type=int, default=2, help="workers per role (2)")
    parser.add_argument(
        "--token-us", type=float, default=300.0, help="µs of compute per prompt token (300)"
    )
    parser.add_argument("--seed", type=int, default=0)
    add_output_argument(parser)


@contextlib.asynccontextmanager
async def fleet(
    workers: int,
    disaggregated: bool,
    *,
    seed: int,
    token_us: float | None = None,
    router: Any = None,
) -> AsyncIterator[Any]:
    """`workers` mock workers per role (`token_us` µs of compute per prompt token; None: the
    cost model's default, an 8B model on one H100) and a
    kv-mode frontend (with `router`, a RouterConfig, or the defaults) discovering them, in this
    process; warmed up by one request."""
    from dynamograph.frontend.routing import Mode
    from dynamograph.frontend.server import Frontend, FrontendConfig
    from dynamograph.protocol.engine import Role
    from dynamograph.router.discovery import Discovery, StaticSource, parse_worker_flag
    from dynamograph.worker.cost import CostModel
    from dynamograph.worker.testing import mock_worker

    cost = CostModel() if token_us is None else CostModel(compute_per_token_s=token_us * 1e-6)
    roles = [Role.PREFILL, Role.DECODE] if disaggregated else [Role.AGGREGATED]
    async with contextlib.AsyncExitStack() as stack:
        running = [
            await stack.enter_async_context(
                mock_worker(model=MODEL, role=role, speedup=1.0, cost=cost, seed=seed)
            )
            for role in roles
            for _ in range(workers)
        ]
        discovery = Discovery(StaticSource([parse_worker_flag(w.url) for w in running]))
        frontend = Frontend(FrontendConfig(mode=Mode.KV, router=router), discovery)
        url = await frontend.start()
        stack.push_async_callback(frontend.stop)
        wanted = {w.config.instance_id for w in running}
        for _ in range(1200):  # discovery reads each worker's /v1/engine: well under a minute
            known = {r.instance_id for r in frontend.directory.records()}
            if frontend.directory.ready() and wanted <= known:
                break
            await asyncio.sleep(0.05)
        else:
            raise RuntimeError("the frontend did not discover its workers within a minute")
        # one request first: the router loads the tokenizer on it, outside the measurement
        warm = {"model": MODEL, "prompt": "warm up", "max_tokens": 1}
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + "/v1/completions", json=warm) as r,
        ):
            await r.read()
        yield frontend


async def _turn(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[float, str, int, int]:
    """One streamed turn: (TTFT s, answer text, prompt tokens, cached tokens)."""
    start = time.perf_counter()
    ttft = None
    parts: list[str] = []
    prompt = cached = 0
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            for choice in event.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    parts.append(piece)
            usage = event.get("usage")
            if usage:
                prompt = usage["prompt_tokens"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert ttft is not None, "no token streamed"
    return ttft, "".join(parts), prompt, cached


async def _session(args, builder, url: str, sid: int, speculative: bool) -> list[dict]:
    from .workload import WorkloadBuilder

    assert isinstance(builder, WorkloadBuilder)
    rng = np.random.default_rng([args.seed, sid])
    system = builder.text(np.random.default_rng([args.seed, 0]), args.system_tokens)
    messages = [{"role": "system", "content": system}]
    results = []
    async with aiohttp.ClientSession() as http:
        for turn in range(1, args.turns + 1):
            messages.append({"role": "user", "content": builder.text(rng, args.user_tokens)})
            hints: dict[str, Any] = {"speculative_prefill": True} if speculative else {}
            control = {"session_id": f"s{sid}", **({"action": "open"} if turn == 1 else {})}
            body = {
                "model": MODEL,
                "messages": messages,
                "max_tokens": args.answer_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
                "nvext": {"session_control": control, "agent_hints": hints},
            }
            ttft, answer, prompt, cached = await _turn(http, url, body)
            results.append({"turn": turn, "ttft_s": ttft, "prompt": prompt, "cached": cached})
            messages.append({"role": "assistant", "content": answer})
            await asyncio.sleep(args.think_s)
    return results


async def _run(args, builder, disaggregated: bool, speculative: bool) -> dict:
    async with fleet(args.workers, disaggregated, seed=args.seed, token_us=args.token_us) as fe:
        turns = await asyncio.gather(
            *(_session(args, builder, fe.url, sid, speculative) for sid in range(args.sessions))
        )
        counts = {
            s.labels["outcome"]: s.value
            for family in fe.metrics.speculative.collect()
            for s in family.samples
            if s.name.endswith("_total")
        }
    follow = [t for session in turns for t in session if t["turn"] > 1]
    ttft = np.array([t["ttft_s"] for t in follow]) * 1e3
    return {
        "fleet": "disaggregated" if disaggregated else "aggregated",
        "speculative": speculative,
        "follow_ups": len(follow),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p90_ms": float(np.percentile(ttft, 90)),
        "cached_fraction": sum(t["cached"] for t in follow) / sum(t["prompt"] for t in follow),
        "speculative_done": int(counts.get("done", 0)),
        "speculative_cancelled": int(counts.get("cancelled", 0)),
    }


async def _bench(args) -> list[dict]:
    from dynamograph.protocol.tokenization import get_tokenizer

    from .workload import WorkloadBuilder

    builder = WorkloadBuilder(get_tokenizer("qwen"))
    rows = []
    for disaggregated in (False, True):
        for speculative in (False, True):
            rows.append(await _run(args, builder, disaggregated, speculative))
    return rows


def run(args: argparse.Namespace) -> int:
    rows = asyncio.run(_bench(args))
    print_table(
        "speculative prefill: follow-up turns",
        COLUMNS,
        [
            [
                r["fleet"],
                "yes" if r["speculative"] else "no",
                r["follow_ups"],
                r["ttft_p50_ms"],
                r["ttft_p90_ms"],
                100 * r["cached_fraction"],
                r["speculative_done"],
                r["speculative_cancelled"],
            ]
            for r in rows
        ],
        width=110,
    )
    settings = {k: v for k, v in vars(args).items() if isinstance(v, int | float | str)}
    p50 = {(r["fleet"], r["speculative"]): round(r["ttft_p50_ms"], 1) for r in rows}
    summary = {
        f"{fleet} follow-up TTFT p50 ms (without, with)": [p50[fleet, False], p50[fleet, True]]
        for fleet in ("aggregated", "disaggregated")
    }
    write_json(args.out, "speculative", {"settings": settings, "runs": rows, "summary": summary})
    return 0
