"""A seeded storm of concurrent requests on a small cache: shared prefixes, preemption, client
cancellations and sessions. Every stream keeps the contract and every block comes back."""

import asyncio
import random

import numpy as np
import pytest

from dynamograph.protocol.nvext import parse_nvext
from dynamograph.worker.engine import (
    FinishReason,
    GenerateRequest,
    RequestContext,
    validate_stream,
)
from dynamograph.worker.mock import MockConfig, MockEngine

from .conftest import MODEL

pytestmark = pytest.mark.integration


async def test_storm_keeps_contracts_and_frees_every_block():
    config = MockConfig(model=MODEL, kv_events=False, speedup=2000.0, num_gpu_blocks=40,
                        max_num_seqs=6, max_num_batched_tokens=96, port=0, data_parallel_size=2)  # fmt: skip
    engine = MockEngine(config)
    await engine.start(5)
    rnd = random.Random(7)
    prefixes = [np.random.default_rng(p).integers(1000, 50000, 200).astype("<u4") for p in range(3)]
    outcomes = []

    async def one(i: int) -> None:
        await asyncio.sleep(rnd.random() * 0.05)  # clients arrive at random times (the load)
        prompt = np.concatenate([prefixes[i % 3][: rnd.randint(8, 200)], np.asarray([i], "<u4")])
        max_tokens = rnd.randint(1, 120)
        nvext = None
        if i % 5 == 0:
            action = "open" if i % 10 == 0 else "close"
            nvext = parse_nvext({"session_control": {"session_id": f"s{i % 3}", "action": action}})
        req = GenerateRequest(f"r{i}", prompt, max_tokens, nvext=nvext)
        ctx = RequestContext(req.request_id)
        cancel_after = rnd.randint(1, 20) if rnd.random() < 0.3 else None
        chunks = []
        async for chunk in engine.generate(req, ctx):
            chunks.append(chunk)
            if cancel_after is not None and len(chunks) == cancel_after:
                ctx.cancel()
        validate_stream(chunks, max_tokens=max_tokens)
        outcomes.append(chunks[-1].finish_reason)

    try:
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(60))), 90)
        assert len(outcomes) == 60
        assert FinishReason.LENGTH in outcomes and FinishReason.CANCELLED in outcomes
        preempted = sum(
            engine.metrics.registry.get_sample_value(
                "vllm:num_preemptions_total", {"model_name": MODEL, "engine": str(r)}
            )
            or 0
            for r in range(2)
        )
        assert preempted > 0  # the cache is small enough to force it
        for rank in engine.ranks:
            rank.release_all_holds()  # open sessions end with the engine
            cache = rank.cache
            assert rank.load == 0
            assert all(rc == 0 for rc in cache.ref_count) and cache.num_free == cache.num_blocks
            assert all(cache.block_hash[b] == h for h, b in cache.cached.items())
    finally:
        await engine.cleanup()
