"""The KV-event stream with CURVE (protocol.kv_curve): a worker and the EPP sharing the graph's
key folder index events as without it; a subscriber without the keys, or with another graph's,
gets neither live batches nor a replay."""

import asyncio

import aiohttp
import pytest
import zmq
import zmq.asyncio

from dynamograph.protocol.kv_curve import CurveKeys, create_keys
from dynamograph.protocol.kv_events import encode_seq
from dynamograph.worker.testing import mock_worker
from e2e.waiting import wait_for

from .conftest import MODEL, running_epp

pytestmark = pytest.mark.integration


async def generate(worker, text: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    async with (
        aiohttp.ClientSession() as http,
        http.post(worker.url + "/v1/chat/completions", json=body) as response,
    ):
        assert response.status == 200


def subscriber(
    ctx: zmq.asyncio.Context, endpoint: str, keys: CurveKeys | None
) -> zmq.asyncio.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    if keys is not None:
        keys.subscribe(sub)
    sub.connect(endpoint)
    return sub


async def replayed(ctx: zmq.asyncio.Context, endpoint: str, keys: CurveKeys | None) -> bool:
    """Whether the replay socket answers a request from the start (within 2 s)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        keys.subscribe(dealer)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", encode_seq(0)], flags=zmq.NOBLOCK)
        return bool(await dealer.poll(2000))
    except zmq.Again:  # no peer completed a handshake: nothing to queue the request to
        return False
    finally:
        dealer.close(linger=0)


async def test_with_curve_the_epp_indexes_events_and_others_receive_nothing(tmp_path):
    keys = CurveKeys.load(create_keys(tmp_path / "graph"))
    other = CurveKeys.load(create_keys(tmp_path / "other-graph"))
    ctx = zmq.asyncio.Context()
    try:
        async with (
            mock_worker(model=MODEL, name="curve-a", kv_curve=keys) as worker,
            running_epp([worker], kv_curve=keys) as epp,  # waits for a first replay
        ):
            events = worker.config.kv_events
            assert events is not None and events.replay_endpoint is not None
            keyed = subscriber(ctx, events.endpoint, keys)
            unkeyed = subscriber(ctx, events.endpoint, None)
            wrong = subscriber(ctx, events.endpoint, other)
            try:
                wid = worker.config.instance_id
                # The keyed subscriber is joined once a batch reaches it (ZMQ's slow joiner).
                async with asyncio.timeout(20):
                    i = 0
                    while not await keyed.poll(100):
                        await generate(worker, f"probe {i} " * 40)
                        i += 1
                await wait_for(
                    lambda: epp.router.index.block_count((wid, 0)) > 0,
                    "the EPP to index the worker's blocks",
                )
                await generate(worker, "one more batch for everyone " * 40)
                assert await keyed.poll(2000)
                assert not await unkeyed.poll(0)
                assert not await wrong.poll(0)
                assert await replayed(ctx, events.replay_endpoint, keys)
                assert not await replayed(ctx, events.replay_endpoint, None)
                assert not await replayed(ctx, events.replay_endpoint, other)
            finally:
                for sock in (keyed, unkeyed, wrong):
                    sock.close(linger=0)
    finally:
        ctx.term()
