"""Data-parallel rank selection and session pinning."""

import aiohttp
import numpy as np
import pytest

from dynamograph.worker.engine import GenerateRequest, RequestContext, collect, validate_stream
from dynamograph.worker.mock import MockConfig, MockEngine
from dynamograph.worker.server import DP_RANK_HEADER
from dynamograph.worker.testing import mock_worker
from e2e.waiting import wait_for

from .conftest import MODEL, post_json

pytestmark = pytest.mark.integration


async def test_rank_by_header_and_least_loaded_by_default():
    async with mock_worker(model=MODEL, data_parallel_size=3) as w:
        assert w.config.data_parallel_size == 3
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": "pin me", "max_tokens": 2}
            async with http.post(w.url + "/v1/completions", json=body,
                                 headers={"X-data-parallel-rank": "2"}) as resp:  # fmt: skip
                assert resp.headers[DP_RANK_HEADER] == "2"
            # Keep ranks 0 and 2 busy; an unpinned request must land on rank 1.
            long = {"model": MODEL, "prompt": "busy", "max_tokens": 30000, "stream": True}
            busy = []
            for rank in (0, 2):
                resp = await http.post(w.url + "/v1/completions", json=long,
                                       headers={"X-data-parallel-rank": str(rank)})  # fmt: skip
                assert resp.status == 200
                await resp.content.readline()
                busy.append(resp)
            async with http.post(w.url + "/v1/completions", json=body) as resp:
                assert resp.headers[DP_RANK_HEADER] == "1"
            for resp in busy:
                resp.close()
        log = await get_json(w.url + "/debug/requests")
        assert log["by_dp_rank"]["2"] == 2 and log["by_dp_rank"]["1"] == 1


async def get_json(url):
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return await resp.json()


async def test_session_pins_blocks_until_close():
    # A cache of 24 blocks: other traffic would evict the session's prefix without the pin.
    config = MockConfig(model=MODEL, kv_events=False, speedup=500.0, num_gpu_blocks=24, port=0)
    engine = MockEngine(config)
    await engine.start(1)
    try:
        from dynamograph.protocol.nvext import parse_nvext

        rng = np.random.default_rng(0)
        history = rng.integers(1000, 50000, 160).astype("<u4")  # 10 blocks

        async def turn(rid, tokens, nvext=None, max_tokens=4):
            req = GenerateRequest(rid, tokens, max_tokens, nvext=parse_nvext(nvext))
            chunks = await collect(engine.generate(req, RequestContext(rid)))
            return validate_stream(chunks)

        opened = {"session_control": {"session_id": "s1", "action": "open", "timeout": 60}}
        await turn("t1", history, opened)
        rank = engine.ranks[0]
        assert "s1" in rank.sessions and rank.cache.usage > 0  # pinned while idle
        for i in range(6):  # 6 × 10 blocks of other prompts through a 24-block cache
            await turn(f"other{i}", rng.integers(1000, 50000, 160).astype("<u4"))
        usage = await turn("t2", history, {"session_control": {"session_id": "s1"}})
        assert usage.cached_tokens == 160 - 16  # the pinned prefix survived
        closing = {"session_control": {"session_id": "s1", "action": "close"}}
        await turn("t3", history, closing)
        assert "s1" not in rank.sessions
        assert all(rc == 0 for rc in rank.cache.ref_count)
    finally:
        await engine.cleanup()


async def test_session_times_out():
    async with mock_worker(model=MODEL, kv_events=False) as w:
        nvext = {"session_control": {"session_id": "s2", "action": "open", "timeout": 1}}
        await post_json(w.url, "/v1/completions",
                        {"model": MODEL, "prompt": "hello " * 40, "max_tokens": 2, "nvext": nvext})  # fmt: skip
        rank = w.engine.ranks[0]
        assert "s2" in rank.sessions
        await wait_for(lambda: "s2" not in rank.sessions, "the idle session to expire")
        assert rank.cache.usage == 0.0


async def test_pins_give_way_when_they_alone_block_a_request():
    config = MockConfig(model=MODEL, kv_events=False, speedup=500.0, num_gpu_blocks=24, port=0)
    engine = MockEngine(config)
    await engine.start(1)
    try:
        from dynamograph.protocol.nvext import parse_nvext

        rng = np.random.default_rng(1)
        opened = parse_nvext({"session_control": {"session_id": "s9", "action": "open"}})
        pinned = GenerateRequest(
            "pin", rng.integers(1000, 50000, 160).astype("<u4"), 2, nvext=opened
        )
        validate_stream(await collect(engine.generate(pinned, RequestContext("pin"))))
        rank = engine.ranks[0]
        assert "s9" in rank.sessions
        # 300 + 60 tokens need 23 of 24 blocks: only the session's 10 pinned blocks stand in the way.
        big = GenerateRequest("big", rng.integers(1000, 50000, 300).astype("<u4"), 60)
        usage = validate_stream(await collect(engine.generate(big, RequestContext("big"))))
        assert usage.completion_tokens == 60
        assert "s9" not in rank.sessions
        # Same again, but the request fits at admission and outgrows the unpinned blocks while
        # decoding: it preempts itself, then the pin gives way.
        validate_stream(await collect(engine.generate(pinned, RequestContext("pin"))))
        assert "s9" in rank.sessions
        grows = GenerateRequest("grows", rng.integers(1000, 50000, 100).astype("<u4"), 150)
        usage = validate_stream(await collect(engine.generate(grows, RequestContext("grows"))))
        assert usage.completion_tokens == 150 and "s9" not in rank.sessions
        assert all(rc == 0 for rc in rank.cache.ref_count)
    finally:
        await engine.cleanup()
