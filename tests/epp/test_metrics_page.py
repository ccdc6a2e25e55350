"""The EPP's /metrics page as Prometheus scrapes it, from a real EPP routing to real workers."""

import asyncio

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynamograph.protocol.headers import DESTINATION_ENDPOINT
from e2e.waiting import wait_for

from .conftest import MODEL, chat_body, endpoint_of, set_headers

pytestmark = pytest.mark.integration


async def booked_requests(epp) -> dict[tuple[str, str], float]:
    """(worker, dp_rank) → dynamograph_epp_worker_booked_requests, scraped over HTTP."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{epp.metrics_port}/metrics") as response,
    ):
        assert response.status == 200
        text = await response.text()
    return {
        (sample.labels["worker"], sample.labels["dp_rank"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "dynamograph_epp_worker_booked_requests"
    }


async def test_booked_requests_gauge_counts_the_request_in_flight(epp, workers, client):
    names = {r.serving_endpoint: r.name for r in epp.discovery.records.values()}
    assert await booked_requests(epp) == {(names[endpoint_of(w)], "0"): 0 for w in workers}

    stream = client.stream()
    first, _, _ = await stream.request(chat_body("booked " * 40))
    chosen = names[set_headers(first)[DESTINATION_ENDPOINT]]
    assert await booked_requests(epp) == {
        (names[endpoint_of(w)], "0"): 1 if names[endpoint_of(w)] == chosen else 0 for w in workers
    }

    await stream.finish_response()

    async def all_free() -> bool:
        return set((await booked_requests(epp)).values()) == {0}

    await wait_for(all_free, "the finished request's booking to be freed", within=10)


async def scrape(epp) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the EPP's /metrics page over HTTP: (name, sorted labels) → value."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{epp.metrics_port}/metrics") as response,
    ):
        text = await response.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_the_router_queue_is_visible_on_the_metrics_page():
    """Flow control a user can see: with every worker busy, the queue's depth per priority
    tier, its refusals by reason and the wait-time histogram are on the EPP's /metrics."""
    from dynamograph.protocol.router_config import RouterConfig
    from dynamograph.worker.testing import mock_worker

    from .conftest import MODEL, ExtProcClient, running_epp

    config = RouterConfig(busy_threshold=0.05, queue_max_requests=1, queue_timeout_s=30)
    async with (
        mock_worker(model=MODEL, num_gpu_blocks=64) as w,
        running_epp([w], router=config) as epp,
    ):
        client = ExtProcClient(epp.grpc_port)
        try:
            hog = client.stream()
            first, _, _ = await hog.request(chat_body("hog " * 200))  # books the only worker
            assert not first.HasField("immediate_response")
            queued = client.stream()
            waiting = asyncio.create_task(queued.request(chat_body("wait for me")))
            await wait_for(lambda: epp.pipeline.queue.depth == 1, "the request to queue")
            samples = await scrape(epp)
            assert samples[("dynamograph_epp_queue_depth_by_priority", (("priority", "0"),))] == 1
            full, _, _ = await client.stream().request(chat_body("no room"))
            assert full.immediate_response.status.code == 503
            await hog.finish_response()  # the booking is freed: the queued request goes
            routed, _, _ = await waiting
            assert not routed.HasField("immediate_response")
            samples = await scrape(epp)
            refused = "dynamograph_epp_queue_refusals_total"
            assert samples[(refused, (("reason", "queue_full"),))] == 1
            assert samples[(refused, (("reason", "timed_out"),))] == 0
            assert samples[("dynamograph_epp_queue_wait_seconds_count", ())] == 1
            assert samples[("dynamograph_epp_queue_depth", ())] == 0
        finally:
            await client.close()


async def test_a_follow_up_turn_tokenizes_only_its_new_messages(epp, client):
    """The segment cache on the metrics page: a conversation's second turn finds its history
    tokenized already (the first question, the newline after a message, the generation prompt)
    and tokenizes only the answer and the new question."""
    hits = "dynamograph_epp_tokenizer_segment_cache_hits_total"
    misses = "dynamograph_epp_tokenizer_segment_cache_misses_total"
    key = (("tokenizer", "qwen:qwen2.5-72b-instruct"),)
    first = [{"role": "user", "content": "What is a KV cache? " * 30}]
    follow = [
        *first,
        {"role": "assistant", "content": "A store of attention keys and values. " * 20},
        {"role": "user", "content": "And prefix caching? " * 10},
    ]
    for messages in (first, follow):
        before = await scrape(epp)
        stream = client.stream()
        body = orjson.dumps({"model": MODEL, "messages": messages})
        answer, _, _ = await stream.request(body)
        assert not answer.HasField("immediate_response")
        await stream.finish_response()
    after = await scrape(epp)
    assert after[(misses, key)] - before.get((misses, key), 0) == 2
    assert after[(hits, key)] - before.get((hits, key), 0) == 3
    assert after[("dynamograph_epp_tokenizer_segment_cache_bytes", key)] > 0
