"""The EPP's /metrics page as Prometheus scrapes it, from a real EPP routing to real workers."""

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynamograph.protocol.headers import DESTINATION_ENDPOINT
from e2e.waiting import wait_for

from .conftest import chat_body, endpoint_of, set_headers

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
