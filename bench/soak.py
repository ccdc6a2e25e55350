"""`dynamograph bench soak`: a long run at 80 % of measured capacity with periodic worker kills.

A graph (default `examples/agg.yaml`) runs supervised on this machine (`local/supervisor.py`,
as `dynamograph up` runs it) behind its real Envoy. The soak first measures capacity (closed
loop, `--concurrency` clients, `--measure-s` seconds: answered requests per second), then sends
streamed chats open loop at `--load` × that rate for `--duration` seconds, SIGKILLing one worker
every `--kill-every` seconds (round-robin; the supervisor restarts it). At the end it reports:

- **requests lost** (target 0): no answer within the client's bound (`unanswered`), or a stream
  that ended without `[DONE]` and without an error event (`cut`). Error answers (a status, or an
  SSE error event ending the stream) are counted but not lost: the client was told.
- **leaked bookings** (target 0): the EPP's `dynamograph_epp_worker_booked_requests`, summed,
  once the load has stopped (polled, bounded).
- **memory growth** (target < 5 %) of each process that ran through the judged window (not
  restarted), from `--settle` × the run (default half) to the end, both read with nothing in
  flight (the load pauses at the settle point until its requests have ended and the EPP's
  bookings drained, plus a few seconds; the end is read likewise after the load stopped), so
  memory that scales with the requests in flight is not counted and what is left is what the
  processes kept. A leak grows with the requests served, all run long; the bounded caches a
  process fills early (the EPP's tokenizer segment cache, 64 MB; its KV index, capped by the
  workers' KV blocks) stop growing. Our processes are judged by RSS. Envoy by its live heap
  (`server.memory_allocated`): tcmalloc does not give freed pages back to the OS in a way RSS
  shows (envoyproxy/envoy#39006), so Envoy's RSS is the high-water mark of its largest burst
  (a worker kill's failed and re-routed requests) and is reported beside, not judged. The
  whole curve (every `--sample-s`) is in the JSON, with the EPP's segment-cache bytes and
  Envoy's heap beside the RSS, so a reader sees what filled and when.

It prints a table and writes `soak.json`. `make soak` is the 10-minute run.

The load (`SteadyLoad`, `classify`) and `booked_requests` are also what the fault-injection
suite (tests/faults) drives and checks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from dynamograph.local.stack import Running, Stack

from .report import add_output_argument, print_table, write_json

# What became of one request (the fault suite's categories too).
OK = "ok"  # 200, the stream ended with [DONE]
HTTP_ERROR = "http-error"  # an answer with an error status
STREAM_ERROR = "stream-error"  # 200, then an SSE error event ended the stream
REFUSED = "refused"  # no connection, or closed before any answer: the client knows at once
CUT = "cut"  # 200, then the stream ended without [DONE] or an error event
UNANSWERED = "unanswered"  # nothing within the client's bound: a hang
LOST = (CUT, UNANSWERED)

BOOKED = "dynamograph_epp_worker_booked_requests"
TARGET_RSS_GROWTH = 0.05


@dataclass
class Outcomes:
    counts: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # the first of each kind, to show
    latencies: list[float] = field(default_factory=list)  # seconds, answered requests

    def add(self, kind: str, detail: str, seconds: float) -> None:
        self.counts[kind] += 1
        self.examples.setdefault(kind, detail[:300])
        if kind != UNANSWERED:
            self.latencies.append(seconds)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def lost(self) -> int:
        return sum(self.counts[k] for k in LOST)


def prompt(family: int, rng: random.Random) -> str:
    """A long prefix shared by the family (KV routing has something to keep together) and a
    short unique question."""
    prefix = f"family {family}: " + " ".join(f"fact {family}.{i} is settled." for i in range(60))
    return f"{prefix} Question {rng.random():.9f}: what follows?"


async def classify(
    session: aiohttp.ClientSession, base_url: str, body: dict, bound: float
) -> tuple[str, str]:
    """Send one streamed chat; (outcome, detail). Never raises for a failure of the service."""
    answered = False
    try:
        async with asyncio.timeout(bound):
            async with session.post(f"{base_url}/chat/completions", json=body) as resp:
                answered = True
                if resp.status != 200:
                    return HTTP_ERROR, f"{resp.status} {(await resp.read())[:200]!r}"
                async for line in resp.content:
                    data = line.strip().removeprefix(b"data:").strip()
                    if data == b"[DONE]":
                        return OK, ""
                    if data.startswith(b"{") and b'"error"' in data:
                        event = orjson.loads(data)
                        if "error" in event:
                            return STREAM_ERROR, data.decode(errors="replace")
                return CUT, "stream ended without [DONE] or an error event"
    except TimeoutError:
        return UNANSWERED, f"no {'end' if answered else 'answer'} within {bound:g}s"
    except (aiohttp.ClientError, OSError) as exc:
        return (CUT if answered else REFUSED), repr(exc)


class SteadyLoad:
    """Streamed chats through `base_url` until stopped: `clients` closed loops, or open loop at
    `rate` requests/s. Every request has a bounded timeout; `outcomes` counts what became of
    each. `async with` starts it; leaving waits for every request sent (bounded too)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        clients: int = 3,
        rate: float | None = None,
        timeout: float = 20.0,
        max_tokens: int = 8,
        families: int = 6,
        seed: int = 1,
    ):
        self.base_url, self.model = base_url, model
        self.clients, self.rate, self.timeout = clients, rate, timeout
        self.max_tokens, self.families = max_tokens, families
        self.rng = random.Random(seed)
        self.outcomes = Outcomes()
        self._stop = asyncio.Event()
        self._go = asyncio.Event()  # cleared while paused
        self._go.set()
        self._requests: set[asyncio.Task] = set()  # in flight
        self._tasks: set[asyncio.Task] = set()
        self._session: aiohttp.ClientSession | None = None

    def body(self) -> dict:
        return {
            "model": self.model,
            "messages": [
                {"role": "user", "content": prompt(self.rng.randrange(self.families), self.rng)}
            ],
            "max_tokens": self.max_tokens,
            "stream": True,
        }

    async def one(self) -> str:
        assert self._session is not None
        started = time.monotonic()
        kind, detail = await classify(self._session, self.base_url, self.body(), self.timeout)
        self.outcomes.add(kind, detail, time.monotonic() - started)
        return kind

    async def _closed_loop(self) -> None:
        while not self._stop.is_set():
            await self._go.wait()
            await self._request()

    async def _open_loop(self) -> None:
        assert self.rate
        next_at = time.monotonic()
        while not self._stop.is_set():
            if not self._go.is_set():
                await self._go.wait()
                next_at = time.monotonic()
            self._request()
            next_at += self.rng.expovariate(self.rate)  # Poisson arrivals
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), max(0.0, next_at - time.monotonic()))

    def _request(self) -> asyncio.Task:
        task = asyncio.create_task(self.one())
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)
        return task

    async def pause(self) -> None:
        """Send nothing more until `resume()`; return once every request in flight has ended
        (each is bounded by `timeout`, so this is too)."""
        self._go.clear()
        if self._requests:
            await asyncio.wait(set(self._requests), timeout=self.timeout + 10)

    def resume(self) -> None:
        self._go.set()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def __aenter__(self) -> SteadyLoad:
        # No connection limit: the client must never be the bottleneck it is measuring.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        if self.rate:
            self._spawn(self._open_loop())
        else:
            for _ in range(self.clients):
                self._spawn(self._closed_loop())
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        self._go.set()  # a paused loop sees the stop
        try:
            # Every request is bounded by `timeout`: this wait is too.
            if self._tasks or self._requests:
                await asyncio.wait(self._tasks | self._requests, timeout=self.timeout + 10)
        finally:
            for task in [*self._tasks, *self._requests]:
                task.cancel()
            assert self._session is not None
            await self._session.close()

    async def wait_answered(self, n: int, within: float) -> None:
        """Until `n` more requests have been answered OK (bounded): the service is serving."""
        goal = self.outcomes.counts[OK] + n
        deadline = time.monotonic() + within
        while self.outcomes.counts[OK] < goal:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"fewer than {n} requests answered OK in {within:g}s: {self.outcomes.counts}"
                )
            await asyncio.sleep(0.1)


def booked_requests(metrics_text: str) -> float:
    """Requests the EPP has booked on any worker and not seen finish (its gauge, summed)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name == BOOKED
    )


def epp_metrics_url(stack: Stack) -> str:
    epp = next(p for p in stack.running if p.spec.kind == "epp")
    return f"http://127.0.0.1:{epp.spec.ports['metrics']}/metrics"


async def wait_bookings_drained(
    session: aiohttp.ClientSession, stack: Stack, within: float
) -> float:
    """Poll the EPP until nothing is booked (bounded); the last sum seen."""
    deadline = time.monotonic() + within
    booked = float("nan")
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with session.get(
                epp_metrics_url(stack), timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                booked = booked_requests(await r.text())
            if booked == 0:
                return 0.0
        await asyncio.sleep(0.2)
    return booked


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


SEGMENT_CACHE_BYTES = "dynamograph_epp_tokenizer_segment_cache_bytes"
ENVOY_MEMORY = ("server.memory_allocated", "server.memory_heap_size")


def rss_of(running: list[Running]) -> dict[str, tuple[int, int]]:
    """name -> (pid, RSS in bytes) of every live process."""
    out = {}
    for proc in running:
        rss = rss_bytes(proc.pid) if proc.poll() is None else None
        if rss is not None:
            out[proc.spec.name] = (proc.pid, rss)
    return out


@dataclass
class MemorySample:
    t: float  # seconds since the soak's load started
    rss: dict[str, tuple[int, int]]  # name -> (pid, bytes)
    epp_segment_cache_bytes: float | None
    envoy: dict[str, int]  # ENVOY_MEMORY stats


async def sample_memory(
    session: aiohttp.ClientSession, stack: Stack, started: float
) -> MemorySample:
    """Every process's RSS, and what the EPP and Envoy say their memory holds."""
    segment: float | None = None
    envoy: dict[str, int] = {}
    timeout = aiohttp.ClientTimeout(total=5)
    with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
        async with session.get(epp_metrics_url(stack), timeout=timeout) as r:
            text = await r.text()
        segment = sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == SEGMENT_CACHE_BYTES
        )
    gateway = next((p for p in stack.running if p.spec.kind == "envoy"), None)
    if gateway is not None:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            url = f"http://127.0.0.1:{gateway.spec.ports['admin']}/stats?filter=^server\\.memory"
            async with session.get(url, timeout=timeout) as r:
                for line in (await r.text()).splitlines():
                    name, _, value = line.partition(": ")
                    if name in ENVOY_MEMORY:
                        envoy[name] = int(value)
    return MemorySample(time.monotonic() - started, rss_of(stack.running), segment, envoy)


QUIET_S = 5.0  # after the last request ended: late frees, the EPP's last scrape


async def quiescent_sample(
    session: aiohttp.ClientSession, stack: Stack, started: float
) -> MemorySample:
    """Memory with nothing in flight: the load paused or stopped, bookings drained (bounded)
    and `QUIET_S`. Memory that scales with the requests in flight (Envoy's buffers) is then not
    mistaken for growth."""
    await wait_bookings_drained(session, stack, 30)
    await asyncio.sleep(QUIET_S)
    return await sample_memory(session, stack, started)


async def _sample_every(
    session: aiohttp.ClientSession,
    stack: Stack,
    every: float,
    started: float,
    curve: list[MemorySample],
    outcomes: Outcomes,
    duration: float,
) -> None:
    """Sample memory every `every` s; about once a minute, a progress line."""
    shown = 0.0
    while True:
        sample = await sample_memory(session, stack, started)
        curve.append(sample)
        if sample.t - shown >= 60 or not shown:
            shown = sample.t or 1e-9
            mb = {n: rss // 2**20 for n, (_, rss) in sample.rss.items() if "worker" not in n}
            print(
                f"soak: {sample.t:.0f}/{duration:.0f} s, {outcomes.total} requests, "
                f"{outcomes.lost} lost, RSS MB {mb}",
                flush=True,
            )
        await asyncio.sleep(every)


def rss_growth(first: MemorySample, last: MemorySample) -> dict[str, float]:
    """RSS growth of each process that is the same process (pid) at both samples."""
    return {
        name: last.rss[name][1] / rss - 1
        for name, (pid, rss) in first.rss.items()
        if name in last.rss and last.rss[name][0] == pid
    }


ENVOY_HEAP = "server.memory_allocated"


def memory_growth(first: MemorySample, last: MemorySample, envoy: str | None) -> dict[str, float]:
    """What the soak judges: RSS growth of each process, but Envoy's (`envoy`, its process
    name) by its live heap, when both samples have it."""
    growth = rss_growth(first, last)
    if envoy in growth and first.envoy.get(ENVOY_HEAP) and ENVOY_HEAP in last.envoy:
        growth[envoy] = last.envoy[ENVOY_HEAP] / first.envoy[ENVOY_HEAP] - 1
    return growth


def curve_json(curve: list[MemorySample]) -> list[dict]:
    return [
        {
            "t": round(m.t, 1),
            "rss_mb": {name: round(rss / 2**20, 1) for name, (_, rss) in m.rss.items()},
            "pid": {name: pid for name, (pid, _) in m.rss.items()},
            "epp_segment_cache_mb": (
                None
                if m.epp_segment_cache_bytes is None
                else round(m.epp_segment_cache_bytes / 2**20, 1)
            ),
            "envoy_mb": {k: round(v / 2**20, 1) for k, v in m.envoy.items()},
        }
        for m in curve
    ]


# ---- the benchmark ----------------------------------------------------------------------------


async def _kill_round_robin(engines: list[Running], every: float, kills: list[str]) -> None:
    """SIGKILL the next engine every `every` seconds (one still down is skipped)."""
    for victim in itertools.cycle(engines):
        await asyncio.sleep(every)
        if victim.poll() is None:
            os.kill(victim.pid, signal.SIGKILL)
            kills.append(victim.spec.name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dynamograph.local.up import DEFAULT_GRAPH

    parser.add_argument("--graph", type=Path, default=DEFAULT_GRAPH, help="DynamoGraph YAML")
    parser.add_argument("--duration", type=float, default=600.0, help="soak seconds (default 600)")
    parser.add_argument("--load", type=float, default=0.8, help="fraction of measured capacity")
    parser.add_argument(
        "--kill-every", type=float, default=60.0, help="seconds between worker kills"
    )
    parser.add_argument(
        "--measure-s", type=float, default=20.0, help="capacity measurement seconds"
    )
    parser.add_argument("--concurrency", type=int, default=16, help="clients while measuring")
    parser.add_argument("--speedup", type=float, default=None, help="mock engines' speedup")
    parser.add_argument("--timeout", type=float, default=30.0, help="each request's bound (s)")
    parser.add_argument(
        "--settle",
        type=float,
        default=0.5,
        help="memory growth is judged from this fraction of the run to its end (default 0.5)",
    )
    parser.add_argument(
        "--sample-s", type=float, default=10.0, help="seconds between memory samples"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a 60 s soak (10 s measuring, a kill every 15 s) unless --duration etc. say otherwise",
    )
    add_output_argument(parser)


QUICK = {"duration": 60.0, "measure_s": 10.0, "kill_every": 15.0}


def run(args: argparse.Namespace) -> int:
    if args.quick:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        for key, value in QUICK.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    result = asyncio.run(soak(args))
    rows = [[k, v] for k, v in result["summary"].items()]
    print_table("soak", ["measure", "value"], rows, width=100)
    write_json(args.out, "soak", result)
    return 0 if result["passed"] else 1


async def soak(args: argparse.Namespace) -> dict:
    from dynamograph.local.supervisor import supervised
    from dynamograph.local.up import new_stack
    from dynamograph.protocol.graph import load_graph

    graph = load_graph(args.graph)
    # The run's logs stay next to the JSON, for a look at what the kills did.
    stack = new_stack(graph, args.out / "soak-run" / graph.name, args.speedup)
    base_url, model = stack.plan.base_url, stack.plan.model
    async with supervised(stack) as supervisor, aiohttp.ClientSession() as session:
        measure = SteadyLoad(base_url, model, clients=args.concurrency, timeout=args.timeout)
        async with measure:
            await asyncio.sleep(args.measure_s)
        capacity = measure.outcomes.counts[OK] / args.measure_s
        rate = max(capacity * args.load, 0.1)
        engines = [p for p in stack.running if p.spec.kind == "engine"]
        kills: list[str] = []
        curve: list[MemorySample] = []
        started = time.monotonic()
        async with SteadyLoad(base_url, model, rate=rate, timeout=args.timeout) as load:
            killing = asyncio.create_task(_kill_round_robin(engines, args.kill_every, kills))
            sampling = asyncio.create_task(
                _sample_every(
                    session, stack, args.sample_s, started, curve, load.outcomes, args.duration
                )
            )
            try:
                settle_at = args.duration * args.settle
                await asyncio.sleep(settle_at)
                await load.pause()
                settled = await quiescent_sample(session, stack, started)
                load.resume()
                await asyncio.sleep(args.duration - settle_at)
            finally:
                killing.cancel()
                sampling.cancel()
        leaked = await wait_bookings_drained(session, stack, 30)
        end = await quiescent_sample(session, stack, started)
        restarts = {p.spec.name: p.restarts for p in stack.running if p.restarts}
        given_up = [p.spec.name for p in stack.running if p.state == "given-up"]
        events = list(supervisor.events)
    # Only processes that ran through the window (same pid) say anything about leaks.
    envoy = next((p.spec.name for p in stack.running if p.spec.kind == "envoy"), None)
    growth = memory_growth(settled, end, envoy)
    rss = rss_growth(settled, end)
    whole_run = rss_growth(curve[0], end) if curve else {}
    worst = max(growth, key=lambda name: growth[name]) if growth else None
    outcomes = load.outcomes
    summary = {
        "capacity (answered/s)": round(capacity, 2),
        "offered (req/s)": round(rate, 2),
        "requests": outcomes.total,
        **{
            kind: outcomes.counts[kind]
            for kind in (OK, HTTP_ERROR, STREAM_ERROR, REFUSED, CUT, UNANSWERED)
        },
        "requests lost (target 0)": outcomes.lost,
        "worker kills": len(kills),
        "leaked bookings (target 0)": leaked,
        f"max memory growth from {settled.t:.0f} s (target < 5 %)": (
            f"{growth[worst]:.1%} ({worst})" if worst else "-"
        ),
        f"RSS growth from {settled.t:.0f} s": ", ".join(
            f"{name} {g:+.1%}" for name, g in sorted(rss.items())
        )
        or "-",
        "RSS growth over the whole run": ", ".join(
            f"{name} {g:+.1%}" for name, g in sorted(whole_run.items())
        )
        or "-",
    }
    passed = (
        outcomes.lost == 0
        and leaked == 0
        and all(g < TARGET_RSS_GROWTH for g in growth.values())
        and not given_up
    )
    return {
        "summary": summary,
        "passed": passed,
        "config": {k: str(v) for k, v in vars(args).items()},
        "outcomes": dict(outcomes.counts),
        "examples": outcomes.examples,
        "memory_growth": growth,
        "rss_growth": rss,
        "rss_growth_whole_run": whole_run,
        "memory_curve": curve_json([*curve, end]),
        "restarts": restarts,
        "killed": kills,
        "given_up": given_up,
        "supervisor_events": events,
    }
