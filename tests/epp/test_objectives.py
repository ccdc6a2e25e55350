"""GAIE InferenceObjective priorities in the EPP (epp/objectives.py, docs/epp.md): a request
naming an objective with `x-gateway-inference-objective` waits in the router queue with the
objective's priority (the EPP's /metrics shows it by priority) and is served before the
others; a sheddable objective's request gets 429 at once while the worker is busy."""

import asyncio

import aiohttp
import pytest

from dynamograph.protocol.headers import INFERENCE_OBJECTIVE
from dynamograph.protocol.router_config import RouterConfig
from dynamograph.worker.testing import mock_worker
from e2e.waiting import wait_for

from .conftest import MODEL, ExtProcClient, chat_body, running_epp

pytestmark = pytest.mark.integration

# ~6 blocks of 16 tokens: one request holds more than 5% of the worker's 64 blocks (busy)
PROMPT = "A long enough prompt keeps this small worker busy while it is served. " * 6


async def metrics_page(epp) -> str:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{epp.metrics_port}/metrics") as response,
    ):
        return await response.text()


async def test_the_objective_named_by_the_header_orders_the_queue_and_a_sheddable_one_gets_429():
    router = RouterConfig(busy_threshold=0.05, queue_max_requests=4, queue_timeout_s=60)
    async with (
        mock_worker(model=MODEL, num_gpu_blocks=64, name="objectives") as worker,
        running_epp([worker], router=router, objectives={"chat": 7, "batch": -1}) as epp,
    ):
        client = ExtProcClient(epp.grpc_port)
        queue = epp.pipeline.queue
        streams = []
        try:

            async def send(n: int, objective: str | None):
                stream = client.stream()
                streams.append(stream)
                extra = [(INFERENCE_OBJECTIVE, objective)] if objective else []
                first, _, _ = await stream.request(chat_body(f"{n} {PROMPT}"), extra=extra)
                return first

            first = await send(0, None)  # the worker is busy with it now
            assert not first.HasField("immediate_response")
            plain = asyncio.create_task(send(1, None))
            await wait_for(lambda: queue.depth == 1, what="the plain request to wait")
            chat = asyncio.create_task(send(2, "chat"))
            await wait_for(lambda: queue.depth == 2, what="the chat request to wait")
            page = await metrics_page(epp)
            assert 'dynamograph_epp_queue_depth_by_objective_priority{priority="7"} 1.0' in page
            assert 'dynamograph_epp_queue_depth_by_objective_priority{priority="0"} 1.0' in page
            shed = await send(3, "batch")  # sheddable: refused at once, not queued
            assert shed.immediate_response.status.code == 429
            assert queue.depth == 2
            assert 'dynamograph_epp_queue_refusals_total{reason="shed"} 1.0' in (
                await metrics_page(epp)
            )
            streams[0].call.cancel()  # the first request ends: its booking is freed
            # the later-arriving chat request (priority 7) goes first; its booking keeps the
            # worker busy, so the plain one still waits
            assert not (await chat).HasField("immediate_response")
            assert not plain.done() and queue.depth_by_objective_priority() == {0: 1}
            streams[2].call.cancel()
            assert not (await plain).HasField("immediate_response")
        finally:
            for stream in streams:
                stream.call.cancel()
            await client.close()
