"""bench route's dynamo-kv policy end to end: Dynamo's own frontend and KV router (the bench-only
venv of scripts/setup-dynamo.sh) routing to two mock workers through its Dynamo workers.

Each worker is given a document's prefix directly (not through Dynamo); its KV events reach
Dynamo's index only through the relay (the mock's vLLM ZMQ events, Dynamo's KvEventPublisher).
Then every request repeating a document's prefix, sent through Dynamo's frontend, must land on
the worker holding it, with the prefix's blocks served from its cache: the router followed the
engines' real caches, and Dynamo tokenized the text to the ids the mocks did.
"""

import asyncio
import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynamograph.bench.route_client import completion_body, send_one
from dynamograph.bench.route_fleet import (
    WorkerSpec,
    running_fleet,
    scrape_workers,
)
from dynamograph.bench.route_metrics import OK, RequestResult
from dynamograph.bench.route_routers import POLICIES, serve, unavailable
from dynamograph.local.procs import PortPool

pytestmark = pytest.mark.integration

DOCS = {
    "alpha": "Alpha report. " + "The river delta floods every spring and the farmers wait. " * 25,
    "beta": "Beta manual. " + "Tighten each bolt a quarter turn, then check the gauge. " * 25,
}
REPEATS = 4  # routed requests per document: 2 seeding + 8 routed = 10


async def _stored_events(session: aiohttp.ClientSession, url: str) -> int:
    """KV `stored` event batches Dynamo's index applied without error, all workers together
    (the metric's worker_id label is the indexer's, not an engine's)."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        int(sample.value)
        for family in text_string_to_metric_families(text)
        if family.name == "dynamo_component_kv_cache_events_applied"
        for sample in family.samples
        if sample.labels.get("event_type") == "stored" and sample.labels.get("status") == "ok"
    )


async def _events_settled(session: aiohttp.ClientSession, url: str, since: int, least: int) -> int:
    """Wait (bounded) until at least `least` more stored batches were applied and the count
    held still for a poll; returns the count."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    last = -1
    while True:
        count = await _stored_events(session, url)
        if count - since >= least and count == last:
            return count
        assert loop.time() < deadline, f"Dynamo's index applied {count - since} new batches"
        last = count
        await asyncio.sleep(0.5)


async def _send(session, url: str, prompt: str, index: int) -> RequestResult:
    body = completion_body(WorkerSpec.model, prompt, 4)
    return await send_one(session, url + "/v1/completions", body, RequestResult(index=index))


@pytest.mark.timeout(150)
async def test_dynamo_kv_routes_repeated_prefixes_to_their_holder(tmp_path):
    policy = POLICIES["dynamo-kv"]
    reason = unavailable(policy)
    if reason:
        pytest.skip(reason)
    spec = WorkerSpec(num_gpu_blocks=2048, speedup=100.0)
    async with (
        running_fleet(2, spec, tmp_path / "fleet") as workers,
        serve(policy, workers, PortPool(), tmp_path, model=spec.model) as routed,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session,
    ):
        assert routed.pids  # the frontend, whose CPU bench route measures
        assert len(routed.relay_pids) == len(workers)  # a Dynamo worker per mock, apart
        holder = dict(zip(DOCS, workers, strict=True))
        applied = await _stored_events(session, routed.url)
        seeded = await asyncio.gather(
            *(_send(session, holder[d].url, DOCS[d], i) for i, d in enumerate(DOCS))
        )
        assert [r.status for r in seeded] == [OK, OK], [r.error for r in seeded]
        # each seeded prefill stores blocks on its worker: one batch each at least
        await _events_settled(session, routed.url, applied, least=len(workers))
        before = await scrape_workers(workers)
        results = {}
        for k in range(REPEATS):
            for d, doc in DOCS.items():
                prompt = doc + f"Question {k}: what comes next?"
                results[d, k] = await _send(session, routed.url, prompt, len(results))
        after = await scrape_workers(workers)
    assert all(r.status == OK for r in results.values()), [r.error for r in results.values()]
    served = {w.name: after[w.name].requests - before[w.name].requests for w in workers}
    assert served == {holder[d].name: REPEATS for d in DOCS}, served
    for (d, _), r in results.items():
        # the document's whole blocks (all but the partial last one) came from the holder's cache
        assert r.cached_tokens >= seeded[list(DOCS).index(d)].prompt_tokens - spec.block_size, (
            d,
            r.cached_tokens,
            r.prompt_tokens,
        )
    # every request Dynamo forwarded was recorded with the mock's own report
    engine_view = json.loads((tmp_path / "dynamo-engine.json").read_text())
    assert engine_view["requests"] == len(results)
    assert engine_view["engine_ttft_p50_s"] is not None
    # and bench route finds each answer's record by its id: the engine's TTFT, not the frontend's
    recorded = {
        row["request_id"]: row["ttft_ms"] / 1e3
        for path in tmp_path.glob("dynamo-worker-*.jsonl")
        for row in map(json.loads, path.read_text().splitlines())
    }
    answered = list(results.values())
    assert routed.engine_view is not None
    await routed.engine_view(answered)
    for r in answered:
        assert r.response_id is not None and r.response_id.startswith("cmpl-"), r.response_id
        assert r.engine_ttft_s == recorded[r.response_id.removeprefix("cmpl-")]
        assert r.engine_e2e_s is not None and r.engine_e2e_s >= r.engine_ttft_s
