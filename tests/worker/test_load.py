"""Load behaviour of the simulated engine: queueing, batch limits, preemption and cancellation.

Driven at the engine level (MockEngine.generate, the LLMEngine contract) with a high speedup;
every assertion is on simulated time, so results do not depend on this machine's speed.
"""

import asyncio

import aiohttp
import numpy as np
import pytest

from dynamograph.worker.engine import (
    FinishReason,
    GenerateRequest,
    RequestContext,
    collect,
    validate_stream,
)
from dynamograph.worker.mock import MockConfig, MockEngine
from dynamograph.worker.testing import mock_worker
from e2e.waiting import wait_for

from .conftest import MODEL

pytestmark = pytest.mark.integration


async def started(**overrides) -> MockEngine:
    config = MockConfig(model=MODEL, kv_events=False, speedup=500.0, port=0, **overrides)
    engine = MockEngine(config)
    await engine.start(worker_id=7)
    return engine


def prompt(i: int, n: int = 64) -> np.ndarray:
    rng = np.random.default_rng(i)
    return rng.integers(1000, 50000, size=n).astype("<u4")


async def run(engine, i, n=64, max_tokens=16):
    req = GenerateRequest(request_id=f"r{i}", prompt_tokens=prompt(i, n), max_tokens=max_tokens)
    chunks = await collect(engine.generate(req, RequestContext(req.request_id)))
    validate_stream(chunks, max_tokens=max_tokens)
    return chunks[-1]


async def test_ttft_grows_with_queue_depth():
    engine = await started(max_num_seqs=2)
    try:
        mean_ttft = {}
        for depth in (1, 4, 8):
            outs = await asyncio.gather(*(run(engine, 100 * depth + i) for i in range(depth)))
            mean_ttft[depth] = sum(o.timing.ttft for o in outs) / depth
            assert all(o.finish_reason is FinishReason.LENGTH for o in outs)
        assert mean_ttft[1] < mean_ttft[4] < mean_ttft[8]
        assert mean_ttft[8] > 3 * mean_ttft[1]
    finally:
        await engine.cleanup()


async def test_throughput_saturates_at_max_num_seqs():
    engine = await started(max_num_seqs=4)
    try:
        throughput = {}
        peak_running = 0

        async def watch():
            nonlocal peak_running
            while True:  # samples once every loop turn (not a wait)
                peak_running = max(peak_running, engine.ranks[0].gauges().running)
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        for conc in (1, 2, 4, 8, 16):
            outs = await asyncio.gather(
                *(run(engine, 1000 * conc + i, max_tokens=32) for i in range(conc))
            )
            start = min(o.timing.arrival for o in outs)
            end = max(o.timing.finished for o in outs)
            throughput[conc] = sum(o.usage.completion_tokens for o in outs) / (end - start)
        watcher.cancel()
        assert peak_running <= 4
        assert throughput[2] > 1.5 * throughput[1]
        assert throughput[4] > 1.5 * throughput[2]
        # Beyond the batch limit requests only queue: throughput stays flat.
        assert throughput[8] < 1.15 * throughput[4]
        assert throughput[16] < 1.15 * throughput[4]
    finally:
        await engine.cleanup()


async def test_preempted_requests_finish_and_free_every_block():
    # 16 blocks of 16 tokens; three requests growing to 7 blocks each cannot run together.
    engine = await started(num_gpu_blocks=16, block_size=16, max_num_seqs=8)
    try:
        outs = await asyncio.gather(*(run(engine, i, n=50, max_tokens=60) for i in range(3)))
        assert all(o.usage.completion_tokens == 60 for o in outs)
        preemptions = engine.metrics.registry.get_sample_value(
            "vllm:num_preemptions_total", {"model_name": MODEL, "engine": "0"}
        )
        assert preemptions and preemptions > 0
        cache = engine.ranks[0].cache
        assert cache.num_free == cache.num_blocks and cache.usage == 0.0
        assert all(rc == 0 for rc in cache.ref_count)
    finally:
        await engine.cleanup()


async def test_cancel_through_context_frees_blocks():
    engine = await started()
    try:
        req = GenerateRequest(request_id="c1", prompt_tokens=prompt(1, 200), max_tokens=10_000)
        ctx = RequestContext("c1")
        chunks = []
        async for chunk in engine.generate(req, ctx):
            chunks.append(chunk)
            if len(chunks) == 3:
                assert engine.ranks[0].cache.usage > 0
                ctx.cancel()
        validate_stream(chunks)
        assert chunks[-1].finish_reason is FinishReason.CANCELLED
        assert engine.ranks[0].cache.usage == 0.0
    finally:
        await engine.cleanup()


async def test_client_disconnect_cancels_and_frees_blocks():
    async with mock_worker(model=MODEL) as w:
        rank = w.engine.ranks[0]
        body = {
            "model": MODEL,
            "prompt": "keep talking " * 100,
            "max_tokens": 30000,
            "stream": True,
        }
        async with aiohttp.ClientSession() as http:
            resp = await http.post(w.url + "/v1/completions", json=body)
            assert resp.status == 200
            for _ in range(3):
                assert (await resp.content.readline()).startswith(b"data: ")
                await resp.content.readline()
            assert rank.cache.usage > 0 and rank.gauges().running == 1
            resp.close()  # the client goes away mid-stream
        await wait_for(
            lambda: rank.cache.usage == 0.0 and rank.load == 0, "the abandoned request to be freed"
        )
        assert all(rc == 0 for rc in rank.cache.ref_count)


async def test_lifecycle_cleanup_is_idempotent_and_safe_without_start():
    never = MockEngine(MockConfig(model=MODEL, kv_events=False))
    await never.cleanup()
    await never.cleanup()
    broken = MockEngine(MockConfig(model=MODEL, tokenizer="/nonexistent/tokenizer.json"))
    with pytest.raises(ValueError, match="unknown tokenizer"):
        await broken.start(1)
    await broken.cleanup()
    engine = await started()
    await engine.drain(grace=1.0)
    req = GenerateRequest(request_id="late", prompt_tokens=prompt(1), max_tokens=2)
    with pytest.raises(Exception, match="draining"):
        await collect(engine.generate(req, RequestContext("late")))
    await engine.cleanup()
    await engine.cleanup()
