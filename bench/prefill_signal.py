"""`dynamograph bench prefill-signal`: how late the EPP learns that a prefill is done, by signal.

The EPP frees a request's prefill load when it learns the engine computed the prompt. Two
signals, measured on the same requests: `first chunk` (the first response body chunk reaching
the EPP: what it used when Envoy sent it the response body), `headers` (the response headers:
what it used when the body was not sent; the mock engine sends them with its first token, vLLM
before computing anything) and `kv event` (what it uses now that the response body is not sent:
the picked worker's KV events storing the prompt's last full block; for a prompt with no
uncached full block, the response headers). Lag = the EPP's mark
minus the worker's first token (the engine's first output, `first_output` in the worker's
request log), both wall clock in this one process.

Real parts: mock workers publishing vLLM KV events over ZMQ, the EPP (gRPC, KV-event
ingestion), a real Envoy with the response body sent FULL_DUPLEX_STREAMED so that both signals
happen on every request (the EPP's first-chunk mark is recorded instead of applied, so the KV
events still mark the prefill). Requests one at a time: streamed and non-streamed chats with a
long unique prompt, and streamed two-token completions.
"""

import argparse
import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from .report import add_output_argument, print_table, write_json

MODEL = "Qwen/Qwen3-0.6B"
KINDS = ("long prompt, streamed", "long prompt, not streamed", "short prompt, streamed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=20, help="requests per kind (20)")
    parser.add_argument(
        "--prompt-words", type=int, default=1500, help="words of a long prompt (1500)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="tokens each answer generates (64)"
    )
    parser.add_argument(
        "--speedup", type=float, default=10.0, help="mock workers' time speedup (10)"
    )
    add_output_argument(parser)


class Marks:
    """Per request (in order): when the EPP saw its first response chunk, its response headers,
    and when the KV events ended its prefill; and whether the events were to end it."""

    def __init__(self, epp: Any) -> None:
        from dynamograph.epp import extproc

        self.rows: list[dict[str, Any]] = []
        rows = self.rows
        active, picker = epp.router.active, epp.service.picker
        pick, blocks_stored = picker.pick, active.blocks_stored

        async def recording_pick(path, headers, body, subset):  # type: ignore[no-untyped-def]
            route = await pick(path, headers, body, subset)
            guard = route.guard
            rows.append(
                {"guard": guard, "awaited": guard is not None and guard.awaits_stored_blocks}
            )
            return route

        def recording_blocks_stored(slot, keys):  # type: ignore[no-untyped-def]
            pending = [r for r in rows if "kv" not in r and r["guard"] is not None]
            blocks_stored(slot, keys)
            now = time.time()
            for row in pending:
                if row["guard"].prefill_done:
                    row["kv"] = now

        on_headers = extproc.Exchange._on_response_headers

        def recording_headers(exchange, headers):  # type: ignore[no-untyped-def]
            rows[-1].setdefault("headers", time.time())
            return on_headers(exchange, headers)

        def recording_first_chunk(exchange):  # type: ignore[no-untyped-def]
            rows[-1].setdefault("chunk", time.time())  # recorded, not applied

        picker.pick = recording_pick
        active.blocks_stored = recording_blocks_stored
        self._restore = [
            (extproc.Exchange, "_on_response_headers", on_headers),
            (extproc.Exchange, "_mark_first_token", extproc.Exchange._mark_first_token),
        ]
        extproc.Exchange._on_response_headers = recording_headers  # type: ignore[method-assign]
        extproc.Exchange._mark_first_token = recording_first_chunk  # type: ignore[method-assign]

    def restore(self) -> None:
        for owner, name, value in self._restore:
            setattr(owner, name, value)


@contextlib.asynccontextmanager
async def _stack(args: argparse.Namespace) -> AsyncIterator[tuple[Any, Any, list[Any]]]:
    from dynamograph.epp.server import Epp, EppSettings
    from dynamograph.local.envoy import envoy_config, run_envoy
    from dynamograph.protocol.router_config import RouterConfig
    from dynamograph.router.discovery import StaticSource, WorkerTarget
    from dynamograph.worker.testing import free_port, mock_worker

    async with contextlib.AsyncExitStack() as stack:
        workers = [
            await stack.enter_async_context(
                mock_worker(model=MODEL, name=f"prefill-signal-{i}", speedup=args.speedup)
            )
            for i in range(2)
        ]
        targets = [WorkerTarget(w.url, w.url, w.url.removeprefix("http://")) for w in workers]
        epp = Epp(
            EppSettings(
                host="127.0.0.1",
                grpc_port=0,
                health_port=0,
                metrics_port=0,
                router=RouterConfig(),
                scrape_interval=0.1,
            ),
            StaticSource(targets),
        )
        await epp.start()
        stack.push_async_callback(epp.stop)
        await _until(lambda: len(epp.router.workers()) == len(workers))
        config = envoy_config(
            free_port(),
            free_port(),
            f"127.0.0.1:{epp.grpc_port}",
            # the old mode: the body goes to the EPP
            processing_mode={"response_body_mode": "FULL_DUPLEX_STREAMED"},
        )
        envoy = await stack.enter_async_context(run_envoy(config))
        yield epp, envoy, workers


async def _until(condition: Callable[[], bool], within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError("the EPP did not get there in time")
        await asyncio.sleep(0.01)


def _request(kind: str, i: int, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    if kind.startswith("short"):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": args.max_tokens, "stream": True}
        return "/v1/completions", body
    rng = random.Random(i)
    words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "kernel", "cache"))
                     for _ in range(args.prompt_words))  # fmt: skip
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{kind} {i}: {words}"}],
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "stream": kind.endswith(", streamed"),
    }
    return "/v1/chat/completions", body


async def _first_outputs(http: aiohttp.ClientSession, workers: list[Any]) -> dict[str, float]:
    found: dict[str, float] = {}
    for worker in workers:
        async with http.get(worker.url + "/debug/requests") as response:
            for entry in (await response.json())["recent"]:
                if "first_output" in entry:
                    found[entry["request_id"]] = entry["first_output"]
    return found


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50_ms": statistics.median(ordered) * 1e3,
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
        "max_ms": ordered[-1] * 1e3,
    }


async def _main(args: argparse.Namespace) -> int:
    results: dict[str, dict[str, Any]] = {}
    async with _stack(args) as (epp, envoy, workers), aiohttp.ClientSession() as http:
        marks = Marks(epp)
        try:
            for kind in KINDS:
                lags: dict[str, list[float]] = {"first chunk": [], "headers": [], "kv event": []}
                for i in range(args.requests):
                    path, body = _request(kind, i, args)
                    rid = f"prefill-signal-{kind[:5]}-{i}-{time.time_ns()}"
                    async with http.post(
                        envoy.url + path, json=body, headers={"x-request-id": rid}
                    ) as response:
                        await response.read()
                        served_id = response.headers.get("x-request-id", rid)
                        if response.status != 200:
                            raise RuntimeError(f"{kind}: HTTP {response.status}")
                    row = marks.rows[-1]
                    # Envoy ends the exchange just after the client has the answer
                    await _until(lambda: not row["guard"].booked)  # noqa: B023 (awaited here)
                    first = (await _first_outputs(http, workers))[served_id]
                    new = row.get("kv") if row["awaited"] else row.get("headers")
                    if new is None:
                        raise RuntimeError(f"{kind}: the KV events never ended the prefill")
                    lags["first chunk"].append(row["chunk"] - first)
                    lags["headers"].append(row["headers"] - first)
                    lags["kv event"].append(new - first)
                results[kind] = {signal: _stats(values) for signal, values in lags.items()}
                results[kind]["kv_event_awaited"] = marks.rows[-1]["awaited"]
        finally:
            marks.restore()
    rows = [
        [kind, signal, s["p50_ms"], s["p90_ms"], s["max_ms"]]
        for kind, by_signal in results.items()
        for signal, s in by_signal.items()
        if isinstance(s, dict)
    ]
    print_table(
        f"EPP prefill-done mark after the worker's first token, ms ({args.requests} requests "
        f"per kind, {args.max_tokens}-token answers, workers at speedup {args.speedup:g}; short "
        "prompts: the response headers stand for the KV event)",
        ["requests", "signal", "lag p50 ms", "lag p90 ms", "lag max ms"],
        rows,
    )
    write_json(args.out, "prefill_signal", {"requests_per_kind": args.requests,
                                            "max_tokens": args.max_tokens,
                                            "speedup": args.speedup, "lag": results})  # fmt: skip
    return 0


def run(args: argparse.Namespace) -> int:
    from dynamograph.local.envoy import EnvoyNotFound, find_envoy

    try:
        find_envoy()
    except EnvoyNotFound as exc:
        print(f"dynamograph bench prefill-signal needs Envoy: {exc}")
        return 2
    return asyncio.run(_main(args))
