"""Disaggregated prefill → decode with vLLM's kv_transfer_params, at the engine and over HTTP."""

import asyncio

import numpy as np
import pytest

from dynamograph.protocol.engine import Role
from dynamograph.worker.engine import (
    FinishReason,
    GenerateRequest,
    RequestContext,
    collect,
    validate_stream,
)
from dynamograph.worker.handoff import PULL_PATH
from dynamograph.worker.mock import MockConfig, MockEngine, held_to_json
from dynamograph.worker.testing import mock_worker
from e2e.waiting import wait_for

from .conftest import MODEL, post_json

pytestmark = pytest.mark.integration

PROMPT = np.random.default_rng(5).integers(1000, 50000, 600).astype("<u4")  # 37.5 blocks


async def test_engine_level_handoff_charges_transfer_instead_of_recompute():
    prefill = MockEngine(
        MockConfig(model=MODEL, role=Role.PREFILL, kv_events=False, speedup=500, port=0)
    )
    await prefill.start(11)

    async def in_process_pull(params):
        held = prefill.take_transfer(params["remote_engine_id"], params["remote_request_id"])
        return None if held is None else held_to_json(held, prefill.config.block_size)

    decode = MockEngine(MockConfig(model=MODEL, role=Role.DECODE, kv_events=False, speedup=500, port=0),
                        kv_puller=in_process_pull)  # fmt: skip
    await decode.start(22)
    try:
        leg1 = GenerateRequest("p1", PROMPT, 1, kv_transfer_params={"do_remote_decode": True})
        chunks = await collect(prefill.generate(leg1, RequestContext("p1")))
        validate_stream(chunks, max_tokens=1)
        done = chunks[-1]
        params = done.kv_transfer_params
        assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "11_dp0"
        assert len(params["remote_block_ids"]) == 600 // 16
        held_rank = prefill.ranks[0]
        assert len(held_rank.transfers) == 1 and held_rank.cache.usage > 0

        leg2 = GenerateRequest("d1", PROMPT, 8, kv_transfer_params=params)
        chunks = await collect(decode.generate(leg2, RequestContext("d1")))
        usage = validate_stream(chunks, max_tokens=8)
        last = chunks[-1]
        assert last.finish_reason is FinishReason.LENGTH
        assert usage.cached_tokens == 600 // 16 * 16  # pulled, not recomputed
        assert last.timing.transfer_time > 0
        assert last.timing.ttft < done.timing.ttft  # loading KV beats recomputing it
        # The pull released the prefill's blocks.
        assert len(held_rank.transfers) == 0
        assert all(rc == 0 for rc in held_rank.cache.ref_count)

        # Pulling again finds nothing: no transfer; only the decode's own prefix cache helps.
        again = GenerateRequest("d2", PROMPT[:300], 2, kv_transfer_params=params)
        chunks = await collect(decode.generate(again, RequestContext("d2")))
        assert validate_stream(chunks).cached_tokens == 299 // 16 * 16
        assert chunks[-1].timing.transfer_time == 0
    finally:
        await decode.cleanup()
        await prefill.cleanup()


async def test_http_handoff_and_orphan_timeout():
    async with (
        mock_worker(model=MODEL, role=Role.PREFILL, transfer_timeout=0.6) as p,
        mock_worker(model=MODEL, role=Role.DECODE) as d,
    ):
        prompt = PROMPT.tolist()
        leg1 = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": False,
                "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
        resp = await post_json(p.url, "/v1/completions", leg1)
        params = resp["kv_transfer_params"]
        assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == p.server.port
        assert resp["usage"]["completion_tokens"] == 1

        leg2 = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "kv_transfer_params": params,
                "nvext": {"extra_fields": ["worker_id", "timing"]}}  # fmt: skip
        out = await post_json(d.url, "/v1/completions", leg2)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 592
        assert out["nvext"]["worker_id"]["decode_worker_id"] == d.config.instance_id
        assert "kv_transfer_params" not in out
        assert all(rc == 0 for rc in p.engine.ranks[0].cache.ref_count)
        # The pull is one-shot.
        gone = {k: params[k] for k in ("remote_engine_id", "remote_request_id")}
        await post_json(p.url, PULL_PATH, gone, expect=404)

        # A prefill whose decode never comes is freed after the timeout.
        await post_json(p.url, "/v1/completions", leg1)
        rank = p.engine.ranks[0]
        assert len(rank.transfers) == 1
        await wait_for(lambda: not len(rank.transfers), "the unpulled prefill to time out")
        assert all(rc == 0 for rc in rank.cache.ref_count)
        nvext = await post_json(
            p.url, "/v1/completions", {**leg1, "nvext": {"extra_fields": ["worker_id"]}}
        )
        assert nvext["nvext"]["worker_id"]["prefill_worker_id"] == p.config.instance_id
        # vLLM's hand-off: no bootstrap address unless asked (`bootstrap`, SGLang's path)
        assert p.config.bootstrap_port is None


async def test_new_prefills_wait_for_held_blocks_to_be_pulled():
    config = MockConfig(model=MODEL, role=Role.PREFILL, kv_events=False, speedup=500,
                        num_gpu_blocks=48, port=0)  # fmt: skip
    prefill = MockEngine(config)
    await prefill.start(3)
    try:
        held = GenerateRequest("h1", PROMPT, 1, kv_transfer_params={"do_remote_decode": True})
        done = (await collect(prefill.generate(held, RequestContext("h1"))))[-1]
        rank = prefill.ranks[0]
        assert rank.cache.num_free == 48 - 600 // 16
        # 300 tokens need 19 blocks; 11 are free: the request waits for the held ones.
        other = GenerateRequest("h2", PROMPT[:300] + 1, 1)
        task = asyncio.create_task(collect(prefill.generate(other, RequestContext("h2"))))
        await wait_for(lambda: rank.gauges().waiting == 1, "the second prefill to queue")
        assert not task.done()
        assert prefill.take_transfer(done.kv_transfer_params["remote_engine_id"], "h1")
        chunks = await asyncio.wait_for(task, 10)
        assert validate_stream(chunks).completion_tokens == 1
    finally:
        await prefill.cleanup()
