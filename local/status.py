"""The status view of a local stack: per-worker load, KV cache usage and prefix hit rate.

Scrapes each engine's `/metrics` (vLLM's metric names, docs/worker.md) and renders one rich
table with the OpenAI base URL above it. Parsing and rendering are pure (`sample_from_metrics`,
`render`); `scrape` is the only I/O. Each row shows the process's supervision state (running,
starting, backing-off, given-up), its restarts and how its last run ended, so a killed worker is
visible while it comes back and routing carries on over the rest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group
from rich.table import Table
from rich.text import Text

from . import stack
from .stack import Running

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
REQUESTS = "vllm:request_success"
TTFT = "vllm:time_to_first_token_seconds"


@dataclass(frozen=True)
class EngineSample:
    """One scrape of one engine (values summed over data-parallel ranks; usage averaged)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1
    prefix_queries: float = 0.0  # tokens looked up in the prefix cache
    prefix_hits: float = 0.0  # of which found
    requests: float = 0.0  # finished requests
    ttft_sum: float = 0.0  # seconds, engine side (queueing + prefill, no network)
    ttft_count: float = 0.0

    @property
    def hit_rate(self) -> float | None:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else None


def sample_from_metrics(text: str) -> EngineSample:
    """Read the engine metrics the view shows from Prometheus text exposition."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            name = sample.name.removesuffix("_total")
            sums[name] = sums.get(name, 0.0) + sample.value
            counts[name] = counts.get(name, 0) + 1
    usage = sums.get(KV_USAGE, 0.0) / counts[KV_USAGE] if counts.get(KV_USAGE) else 0.0
    return EngineSample(
        running=sums.get(RUNNING, 0.0),
        waiting=sums.get(WAITING, 0.0),
        kv_usage=usage,
        prefix_queries=sums.get(PREFIX_QUERIES, 0.0),
        prefix_hits=sums.get(PREFIX_HITS, 0.0),
        requests=sums.get(REQUESTS, 0.0),
        ttft_sum=sums.get(TTFT + "_sum", 0.0),
        ttft_count=sums.get(TTFT + "_count", 0.0),
    )


async def scrape_engine(session: aiohttp.ClientSession, engine_url: str) -> EngineSample | None:
    """None when the engine does not answer."""
    try:
        async with session.get(
            f"{engine_url}/metrics", timeout=aiohttp.ClientTimeout(total=2)
        ) as resp:
            if resp.status != 200:
                return None
            return sample_from_metrics(await resp.text())
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return None


async def scrape(
    session: aiohttp.ClientSession, running: list[Running]
) -> dict[str, EngineSample | None]:
    """Samples of every live engine, by process name."""
    engines = [
        (p.spec.name, p.spec.engine_url)
        for p in running
        if p.spec.kind == "engine" and p.spec.engine_url is not None and p.exit_code is None
    ]
    samples = await asyncio.gather(*(scrape_engine(session, url) for _, url in engines))
    return {name: s for (name, _), s in zip(engines, samples, strict=True)}


def _state(proc: Running, sample: EngineSample | None) -> Text:
    """The supervision state (`local/supervisor.py`), else how the process ended, else whether
    it answers."""
    if proc.state == stack.GIVEN_UP:
        return Text(stack.GIVEN_UP, style="bold red")
    if proc.state in (stack.BACKING_OFF, stack.STARTING):
        return Text(proc.state, style="yellow")
    if proc.exit_code is not None:
        return Text(proc.describe_exit(), style="bold red")
    if proc.spec.kind == "engine" and sample is None:
        return Text("not answering", style="yellow")
    return Text(stack.RUNNING, style="green")


def _port(proc: Running) -> str:
    """The port a person would talk to: engine, frontend HTTP, EPP gRPC, Envoy listener."""
    ports = proc.spec.ports
    return str(ports.get("engine") or ports.get("http") or ports.get("grpc") or "")


def render(
    graph: str,
    base_url: str,
    model: str,
    running: list[Running],
    samples: dict[str, EngineSample | None],
    events: Sequence[str] = (),
    footer: str = "",
) -> Group:
    """The whole view: the base URL, one row per process, the latest events."""
    header = Text.assemble(
        ("dynamograph ", "bold"),
        (graph, "bold cyan"),
        "  OpenAI base URL ",
        (base_url, "bold green"),
        f"  model {model}",
    )
    table = Table(expand=False)
    columns = ("process", "role", "port", "state", "running", "waiting", "KV cache", "hit rate")
    for column in (*columns, "done", "restarts", "last exit"):
        left = column in ("process", "role", "state", "last exit")
        table.add_column(column, justify="left" if left else "right", no_wrap=True)
    for proc in running:
        sample = samples.get(proc.spec.name)
        role = proc.spec.role or proc.spec.kind
        cells: list[str | Text] = [proc.spec.name, role, _port(proc), _state(proc, sample)]
        if proc.spec.kind == "engine" and sample is not None and proc.exit_code is None:
            rate = sample.hit_rate
            cells += [
                f"{sample.running:.0f}",
                f"{sample.waiting:.0f}",
                f"{sample.kv_usage:.1%}",
                "-" if rate is None else f"{rate:.1%}",
                f"{sample.requests:.0f}",
            ]
        else:
            cells += [""] * (len(columns) - len(cells) + 1)
        cells += [str(proc.restarts), proc.last_exit or ""]
        table.add_row(*cells)
    parts: list = [header, table]
    parts.extend(
        Text(e, style="red" if any(w in e for w in ("exited", "killed", "gave up")) else "")
        for e in events[-5:]
    )
    if footer:
        parts.append(Text(footer, style="dim"))
    return Group(*parts)
