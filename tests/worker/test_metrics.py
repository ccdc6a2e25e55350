"""`/metrics` speaks vLLM's names and labels, and the numbers follow what the engine did."""

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynamograph.worker.testing import mock_worker
from e2e.waiting import wait_for

from .conftest import MODEL, post_json

pytestmark = pytest.mark.integration

PROMPT = "Once upon a time in a land far away there lived a dragon. " * 12


async def scrape(url) -> dict:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


async def test_metrics_follow_the_engine():
    async with mock_worker(model=MODEL, num_gpu_blocks=1000, block_size=16, kv_events=False) as w:
        lab = {"model_name": MODEL, "engine": "0"}
        m = await scrape(w.url)
        info = {k: v for (name, k), v in m.items() if name == "vllm:cache_config_info"}
        assert any(("block_size", "16") in k and ("num_gpu_blocks", "1000") in k for k in info)
        assert value(m, "vllm:kv_cache_usage_perc", **lab) == 0.0
        assert value(m, "vllm:num_requests_running", **lab) == 0.0

        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
        first = await post_json(w.url, "/v1/completions", body)
        second = await post_json(w.url, "/v1/completions", body)
        m = await scrape(w.url)
        prompt = first["usage"]["prompt_tokens"]
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert value(m, "vllm:prefix_cache_queries_total", **lab) == 2 * prompt
        assert value(m, "vllm:prefix_cache_hits_total", **lab) == cached > 0
        assert value(m, "vllm:prompt_tokens_total", **lab) == 2 * prompt
        assert value(m, "vllm:generation_tokens_total", **lab) == 6
        assert value(m, "vllm:request_success_total", finished_reason="length", **lab) == 2
        assert value(m, "vllm:time_to_first_token_seconds_count", **lab) == 2
        assert value(m, "vllm:inter_token_latency_seconds_count", **lab) == 4
        assert value(m, "vllm:e2e_request_latency_seconds_count", **lab) == 2

        # While a long request runs: one running, blocks in use.
        long = {"model": MODEL, "prompt": PROMPT, "max_tokens": 15000, "stream": True}
        async with aiohttp.ClientSession() as http:
            resp = await http.post(w.url + "/v1/completions", json=long)
            assert resp.status == 200
            await resp.content.readline()
            m = await scrape(w.url)
            assert value(m, "vllm:num_requests_running", **lab) == 1.0
            assert value(m, "vllm:kv_cache_usage_perc", **lab) > 0.0
            resp.close()

        async def nothing_running():
            m = await scrape(w.url)
            return m if value(m, "vllm:num_requests_running", **lab) == 0.0 else None

        m = await wait_for(nothing_running, "the aborted request to stop running")
        assert value(m, "vllm:kv_cache_usage_perc", **lab) == 0.0
        assert value(m, "vllm:request_success_total", finished_reason="abort", **lab) == 1
