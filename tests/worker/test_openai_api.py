"""The OpenAI surface with the official `openai` client: chat and completions, stream and not."""

import openai
import pytest

from dynamograph.worker.server import DP_RANK_HEADER, WORKER_ID_HEADER

from .conftest import MODEL

pytestmark = pytest.mark.integration

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 60  # ~600 tokens


def client(worker) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)


async def test_completion_not_streaming(worker):
    async with client(worker) as c:
        raw = await c.completions.with_raw_response.create(
            model=MODEL, prompt="Hello world", max_tokens=7
        )
        resp = raw.parse()
    assert raw.headers[WORKER_ID_HEADER] == str(worker.config.instance_id)
    assert raw.headers[DP_RANK_HEADER] == "0"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 7
    assert resp.usage.prompt_tokens == 2  # "Hello world" -> [9707, 1879]
    assert len(resp.choices[0].text.split()) == 7  # every sampled token is one word


async def test_completion_streaming_matches_non_streaming(worker):
    async with client(worker) as c:
        full = await c.completions.create(model=MODEL, prompt="Tell me", max_tokens=6, seed=3)
        stream = await c.completions.create(
            model=MODEL, prompt="Tell me", max_tokens=6, seed=3, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text  # deterministic for (seed, prompt)
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert chunks[-1].usage.completion_tokens == 6


async def test_chat_streaming_and_not(worker):
    messages = [{"role": "user", "content": "Say something"}]
    async with client(worker) as c:
        full = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
        stream = await c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=5, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 5
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


async def test_second_identical_prompt_is_cached_and_faster(worker):
    nvext = {"extra_fields": ["timing", "worker_id"]}
    async with client(worker) as c:
        first = await c.completions.create(
            model=MODEL, prompt=LONG_PROMPT, max_tokens=2, extra_body={"nvext": nvext}
        )
        second = await c.completions.create(
            model=MODEL, prompt=LONG_PROMPT, max_tokens=2, extra_body={"nvext": nvext}
        )
    prompt = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    bs = worker.config.kv_cache_block_size
    assert cached == (prompt - 1) // bs * bs  # every full block but the one holding the last token
    t1, t2 = first.model_extra["nvext"]["timing"], second.model_extra["nvext"]["timing"]
    assert t2["cached_tokens"] == cached
    assert t2["request_received_ms"] >= t1["request_received_ms"] > 0
    assert t2["ttft_ms"] < t1["ttft_ms"] / 2
    ids = second.model_extra["nvext"]["worker_id"]
    assert ids == {"decode_worker_id": worker.config.instance_id, "decode_dp_rank": 0}


async def test_models_lists_the_served_name(worker):
    async with client(worker) as c:
        models = await c.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_reused_request_ids_do_not_collide(worker):
    headers = {"x-request-id": "same-id"}
    async with client(worker) as c:
        running = await c.completions.create(
            model=MODEL, prompt="long", max_tokens=30000, stream=True, extra_headers=headers
        )
        first = await anext(aiter(running))  # "same-id" is now in flight
        assert first.id == "cmpl-same-id"  # vLLM's: its endpoint's prefix, then the header
        second = await c.completions.create(
            model=MODEL, prompt="short", max_tokens=3, extra_headers=headers
        )
        await running.close()
    assert second.usage.completion_tokens == 3
    assert second.id.startswith("cmpl-same-id-")  # made unique while the first one runs


async def test_draining_worker_fails_health_and_refuses_work():
    import aiohttp

    from dynamograph.worker.testing import mock_worker

    async with mock_worker(model=MODEL, kv_events=False) as w, aiohttp.ClientSession() as http:
        async with http.get(w.url + "/health") as resp:
            assert resp.status == 200
        await w.engine.drain(grace=1.0)
        async with http.get(w.url + "/health") as resp:
            assert resp.status == 503
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        async with http.post(w.url + "/v1/completions", json=body) as resp:
            assert resp.status == 503
            assert "draining" in (await resp.json())["error"]["message"]
