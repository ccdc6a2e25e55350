"""The status view of a local stack: per-worker load, KV cache usage and prefix hit rate.

Scrapes each engine's `/metrics` (vLLM's metric names, DESIGN §3.4) and renders one rich table
with the OpenAI base URL above it. Parsing and rendering are pure (`sample_from_metrics`,
`render`); `scrape` is the only I/O. A process that has exited shows as such, so a killed worker
is visible while routing carries on over the rest.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group
from rich.table import Table
from rich.text import Text

from .stack import Running

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
REQUESTS = "vllm:request_success"


@dataclass(frozen=True)
class EngineSample:
    """One scrape of one engine (values summed over data-parallel ranks; usage averaged)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1
    prefix_queries: float = 0.0  # tokens looked up in the prefix cache
    prefix_hits: float = 0.0  # of which found
    requests: float = 0.0  # finished requests

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
    engines = [p for p in running if p.spec.kind == "engine" and p.exit_code is None]
    samples = await asyncio.gather(*(scrape_engine(session, p.spec.engine_url) for p in engines))
    return {p.spec.name: s for p, s in zip(engines, samples, strict=True)}


def _state(proc: Running, sample: EngineSample | None) -> Text:
    if proc.exit_code is not None:
        return Text(proc.describe_exit(), style="bold red")
    if proc.spec.kind == "engine" and sample is None:
        return Text("not answering", style="yellow")
    return Text("up", style="green")


def render(
    graph: str,
    base_url: str,
    model: str,
    running: list[Running],
    samples: dict[str, EngineSample | None],
    events: list[str] = (),
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
    for column in (
        "process",
        "role",
        "state",
        "running",
        "waiting",
        "KV cache",
        "hit rate",
        "done",
    ):
        table.add_column(
            column, justify="left" if column in ("process", "role", "state") else "right"
        )
    for proc in running:
        sample = samples.get(proc.spec.name)
        role = proc.spec.role or proc.spec.kind
        if proc.spec.kind == "engine" and sample is not None and proc.exit_code is None:
            rate = sample.hit_rate
            table.add_row(
                proc.spec.name,
                role,
                _state(proc, sample),
                f"{sample.running:.0f}",
                f"{sample.waiting:.0f}",
                f"{sample.kv_usage:.1%}",
                "-" if rate is None else f"{rate:.1%}",
                f"{sample.requests:.0f}",
            )
        else:
            table.add_row(proc.spec.name, role, _state(proc, sample), "", "", "", "", "")
    parts: list = [header, table]
    parts.extend(
        Text(e, style="red" if "exited" in e or "killed" in e else "") for e in events[-5:]
    )
    if footer:
        parts.append(Text(footer, style="dim"))
    return Group(*parts)
