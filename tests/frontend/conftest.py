"""Frontend test fixtures: real mock workers (worker.testing) and real frontends on 127.0.0.1."""

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynamograph.frontend.routing import Mode
from dynamograph.frontend.server import Frontend, FrontendConfig
from dynamograph.router.discovery import Discovery, StaticSource, parse_worker_flag
from dynamograph.worker.testing import RunningWorker
from e2e.waiting import wait_for


@asynccontextmanager
async def run_frontend(
    engine: RunningWorker | None,
    graph: Iterable[RunningWorker] = (),
    *,
    mode: Mode = Mode.DIRECT,
    **config: Any,
) -> AsyncIterator[Frontend]:
    """A frontend (sidecar of `engine`) that discovers `graph` statically; ready when yielded."""
    graph = list(graph)
    discovery = (
        Discovery(StaticSource([parse_worker_flag(w.url) for w in graph])) if graph else None
    )
    frontend = Frontend(
        FrontendConfig(engine_url=engine.url if engine else None, mode=mode, **config), discovery
    )
    await frontend.start()
    try:
        wanted = {w.config.instance_id for w in graph} | (
            {engine.config.instance_id} if engine else set()
        )
        await wait_for(
            lambda: (
                frontend.directory.ready()
                and wanted <= {r.instance_id for r in frontend.directory.records()}
            ),
            what="frontend to discover its workers",
        )
        yield frontend
    finally:
        for api in _clients.pop(id(frontend), []):
            await api.close()  # its connections, before the server they go to stops
        await frontend.stop()


# The clients `client` made for each running frontend (by id): `run_frontend` closes them.
_clients: dict[int, list[openai.AsyncOpenAI]] = {}


def client(frontend: Frontend, **headers: str) -> openai.AsyncOpenAI:
    """The official client against the frontend; no retries, so every status is seen as sent.
    Closed with the frontend (`run_frontend`)."""
    api = openai.AsyncOpenAI(
        base_url=frontend.url + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=60,
        default_headers=headers or None,
    )
    _clients.setdefault(id(frontend), []).append(api)
    return api


def route(worker: RunningWorker, dp_rank: int | None = None, prefill=None, prefill_rank=None):
    """The routing headers an endpoint picker would set."""
    headers = {"x-worker-instance-id": str(worker.config.instance_id)}
    if dp_rank is not None:
        headers["x-dp-rank"] = str(dp_rank)
    if prefill is not None:
        headers["x-prefill-instance-id"] = str(prefill.config.instance_id)
        if prefill_rank is not None:
            headers["x-prefill-dp-rank"] = str(prefill_rank)
    return headers


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.json()


async def served(worker: RunningWorker) -> dict[str, Any]:
    """What the worker says it served (`GET /debug/requests`)."""
    return await get_json(worker.url + "/debug/requests")


async def engine_gauges(worker: RunningWorker) -> dict[str, float]:
    """Running/waiting requests and KV usage, summed over DP ranks, from the worker's /metrics."""
    async with aiohttp.ClientSession() as session, session.get(worker.url + "/metrics") as r:
        text = await r.text()
    out = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    names = {
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
        "vllm:kv_cache_usage_perc": "kv_usage",
    }
    for family in text_string_to_metric_families(text):
        if family.name in names:
            out[names[family.name]] += sum(s.value for s in family.samples)
    return out


async def frontend_metric(frontend: Frontend, name: str, **labels: str) -> float:
    text = frontend.metrics.exposition().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


@pytest.fixture
def model():
    return "Qwen/Qwen3-0.6B"
