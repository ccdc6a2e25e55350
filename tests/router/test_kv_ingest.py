"""KV-event ingestion keeps up: a burst far larger than ZMQ's default queues, published while
the router's event loop is busy, ends with every batch applied and nothing cleared."""

import asyncio

import numpy as np
import pytest
import zmq.asyncio

from dynamograph.protocol.engine import EngineConfig, KvEventsEndpoint
from dynamograph.protocol.hashing import block_hash_array
from dynamograph.protocol.kv_events import BlockStored
from dynamograph.router.discovery import WorkerRecord
from dynamograph.router.kv_events import KvEventIngest
from dynamograph.router.scheduler import Router
from dynamograph.worker.events import bind_publishers
from e2e.waiting import wait_for

pytestmark = pytest.mark.integration

BS = 64
ENGINE_HASH = 10**15
BURST = 20_000  # ~8 MB of batches: more than ZMQ's 1,000-message queues and TCP buffers hold


def worker(events: str, replay: str) -> WorkerRecord:
    config = EngineConfig(
        model="m", served_model_name="m", context_length=1 << 20, kv_cache_block_size=BS,
        total_kv_blocks=1 << 20, max_num_seqs=8, max_num_batched_tokens=8192,
        instance_id=7, name="w", tokenizer="qwen",
        kv_events=KvEventsEndpoint(endpoint=events, replay_endpoint=replay),
    )  # fmt: skip
    return WorkerRecord("w", 7, "http://127.0.0.1:9", None, config)


async def test_a_burst_beyond_the_queues_is_applied_without_a_clear():
    ctx = zmq.asyncio.Context()
    # the worker's replay keeps fewer batches than the burst: a gap could not be filled
    (publisher,), events_port, replay_port = bind_publishers(
        ctx, "127.0.0.1", 0, 0, 1, buffer_steps=500
    )
    router = Router()
    router.add_worker(7, block_size=BS, total_blocks=1 << 20)
    ingest = KvEventIngest(router)
    cleared = []
    router.replay_failed = lambda *a: cleared.append(a)  # type: ignore[method-assign]
    try:
        ingest.add(worker(f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{replay_port}"))
        (subscriber,) = ingest.subscribers[7]
        publisher.publish([])  # seq 0; the subscriber's catch-up replays it if it joins late
        await wait_for(lambda: subscriber.applied >= 1, "the subscriber to join", within=20)
        tokens = np.arange(BURST * BS, dtype="<u4")
        parent = None
        for i in range(BURST):  # one loop turn: the subscriber reads nothing meanwhile
            block = [ENGINE_HASH + i]  # engine hashes are opaque 64-bit values
            chunk = tokens[i * BS : (i + 1) * BS].tolist()
            publisher.publish([BlockStored(block, parent, chunk, BS, None)])
            parent = ENGINE_HASH + i
        await wait_for(lambda: subscriber.next_seq == BURST + 1, "every batch applied", within=60)
        assert cleared == []
        hashes = block_hash_array(tokens, BS)
        assert router.index.find_matches(hashes) == {(7, 0): BURST}
    finally:
        await ingest.close()
        await publisher.close()
        ctx.destroy(linger=0)


async def test_joining_a_worker_that_publishes_all_along_catches_up_and_keeps_up():
    """The subscriber connects while the worker publishes a batch every few milliseconds: its
    catch-up replay runs while live batches queue behind it, then it reads on, in order, with
    nothing cleared (a ticker that spun while the replay held the queue would hang here)."""
    ctx = zmq.asyncio.Context()
    (publisher,), events_port, replay_port = bind_publishers(ctx, "127.0.0.1", 0, 0, 1)
    router = Router()
    router.add_worker(7, block_size=BS, total_blocks=1 << 20)
    ingest = KvEventIngest(router, interval_s=0.01)
    cleared = []
    router.replay_failed = lambda *a: cleared.append(a)  # type: ignore[method-assign]

    async def publish_all_along(n: int) -> None:
        parent = None
        for i in range(n):
            chunk = list(range(i * BS, (i + 1) * BS))
            publisher.publish([BlockStored([ENGINE_HASH + i], parent, chunk, BS, None)])
            parent = ENGINE_HASH + i
            await asyncio.sleep(0.002)

    try:
        publishing = asyncio.create_task(publish_all_along(600))
        await asyncio.sleep(0.1)  # the worker has a history by the time the EPP joins
        ingest.add(worker(f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{replay_port}"))
        (subscriber,) = ingest.subscribers[7]
        await publishing
        await wait_for(lambda: subscriber.next_seq == 600, "every batch applied", within=30)
        assert cleared == [] and subscriber.replays >= 1
        hashes = block_hash_array(np.arange(600 * BS, dtype="<u4"), BS)
        assert router.index.find_matches(hashes) == {(7, 0): 600}
    finally:
        await ingest.close()
        await publisher.close()
        ctx.destroy(linger=0)
